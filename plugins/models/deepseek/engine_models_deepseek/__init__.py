"""models-deepseek: DeepSeek-V2 (V2-Lite) and DeepSeek-V3 with multi-head latent attention."""

from engine import hookimpl

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@hookimpl
def register_models(register):
    for arch in ARCHITECTURES:
        register(arch, "engine_models_deepseek.model:DeepseekForCausalLM", api=3)
