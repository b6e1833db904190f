"""models-deepseek against the core's model contract: V2-Lite-, V2- and V3-shaped tiny random
checkpoints, greedy tokens and log-probs against transformers, mixed batches with chunked
prefill and preemption, prefix caching; V3's router bias drawn at random. On the cpu-native
platform, whose latent decode runs in C (mla-cpu-native; mla-torch's own decode is compared in
test_latent_cache.py)."""

from engine.testing.models import ModelContract


class TestDeepseek(ModelContract):
    model_class = "engine_models_deepseek.model:DeepseekForCausalLM"
    random_parameters = ("e_score_correction_bias",)
    platform = "cpu-native"
    attention_backend = "mla-cpu-native"
