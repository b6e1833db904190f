"""models-qwen3: Qwen3 dense decoders, and the same as sequence classifiers and rerankers."""

from engine import hookimpl


@hookimpl
def register_models(register):
    register("Qwen3ForCausalLM", "engine_models_qwen3.model:Qwen3ForCausalLM", api=2)
    register(
        "Qwen3ForSequenceClassification", "engine_models_qwen3.model:Qwen3ForSequenceClassification", api=5
    )


@hookimpl
def register_tool_parsers(register):
    register("qwen3_coder", "engine_models_qwen3.tool_parser:Qwen3CoderToolParser", api=3)
