"""models-mamba-hybrid: Mamba2 and the Bamba hybrid on the core's per-request state slots."""

from engine import hookimpl


@hookimpl
def register_models(register):
    register("Mamba2ForCausalLM", "engine_models_mamba_hybrid.mamba2:Mamba2ForCausalLM", api=4)
    register("BambaForCausalLM", "engine_models_mamba_hybrid.bamba:BambaForCausalLM", api=4)
