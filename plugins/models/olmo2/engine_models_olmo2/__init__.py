"""models-olmo2: OLMo 2 dense decoders."""

from engine import hookimpl


@hookimpl
def register_models(register):
    register("Olmo2ForCausalLM", "engine_models_olmo2.model:Olmo2ForCausalLM", api=2)
