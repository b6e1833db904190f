"""models-moe: mixture-of-experts decoders (Mixtral, Qwen3-MoE, Qwen2-MoE) on the core's FusedMoE."""

from engine import hookimpl

ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")


@hookimpl
def register_models(register):
    for arch in ARCHITECTURES:
        register(arch, "engine_models_moe.model:MoeForCausalLM", api=2)
