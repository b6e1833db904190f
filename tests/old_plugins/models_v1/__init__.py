"""A model plugin as written against interface v1 (release 1), frozen: the release-1 Llama
(``model.py``), built on the release-1 ``engine.layers`` — ``RotaryEmbedding`` rotated q and k
itself and ``silu_and_mul`` was a function. Today's layers differ (the models interface is v2),
so the module no longer imports and its forward could not run: the plugin is refused when it
registers, in one line, rather than failing when selected or in the middle of a step."""

from engine import hookimpl


@hookimpl
def register_models(register):
    register("LlamaForCausalLM", "tests.old_plugins.models_v1.model:LlamaForCausalLM", api=1)
