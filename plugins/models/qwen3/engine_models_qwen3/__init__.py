"""models-qwen3: Qwen3 dense decoders."""

from engine import hookimpl


@hookimpl
def register_models(register):
    register("Qwen3ForCausalLM", "engine_models_qwen3.model:Qwen3ForCausalLM", api=2)
