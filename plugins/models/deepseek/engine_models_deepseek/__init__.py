"""models-deepseek: DeepSeek-V2 (V2-Lite) and DeepSeek-V3 with multi-head latent attention, and
V3's multi-token-prediction module (``DeepSeekMTPModel``, built by an MTP drafter)."""

from engine import hookimpl

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@hookimpl
def register_models(register):
    for arch in ARCHITECTURES:
        register(arch, "engine_models_deepseek.model:DeepseekForCausalLM", api=6)
    register("DeepSeekMTPModel", "engine_models_deepseek.mtp:DeepseekMTP", api=6)


@hookimpl
def register_tool_parsers(register):
    register("deepseek_v3", "engine_models_deepseek.tool_parser:DeepSeekV3ToolParser", api=3)
