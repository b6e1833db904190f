"""models-qwen3: Qwen3 dense decoders, and the same as sequence classifiers and rerankers."""

from engine import hookimpl


@hookimpl
def register_models(register):
    register("Qwen3ForCausalLM", "engine_models_qwen3.model:Qwen3ForCausalLM", api=2)
    register(
        "Qwen3ForSequenceClassification", "engine_models_qwen3.model:Qwen3ForSequenceClassification", api=2
    )
