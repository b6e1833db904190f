"""models-deepseek: DeepSeek-V2 (V2-Lite) and DeepSeek-V3 with multi-head latent attention."""

from engine import hookimpl

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@hookimpl
def register_models(register):
    for arch in ARCHITECTURES:
        register(arch, "engine_models_deepseek.model:DeepseekForCausalLM", api=3)


@hookimpl
def register_tool_parsers(register):
    register("deepseek_v3", "engine_models_deepseek.tool_parser:DeepSeekV3ToolParser", api=2)
