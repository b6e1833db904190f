"""models-mamba-hybrid against the core's model contract: log-probs and greedy tokens vs
transformers, mixed batches under chunked prefill (24-token steps over 8-token scan chunks) and,
for the hybrid, preemption; prefix caching is off for both (the state layers), which the kit
checks instead of hits."""

from engine.testing.models import ModelContract


class TestMamba2(ModelContract):
    model_class = "engine_models_mamba_hybrid.mamba2:Mamba2ForCausalLM"
    attention_backend = None


class TestBamba(ModelContract):
    model_class = "engine_models_mamba_hybrid.bamba:BambaForCausalLM"
    attention_backend = "torch"
    platform = "cpu"
