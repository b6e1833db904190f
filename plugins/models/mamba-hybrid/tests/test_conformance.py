"""models-mamba-hybrid against the core's model contract: log-probs and greedy tokens vs
transformers, mixed batches under chunked prefill (24-token steps over 8-token scan chunks) and,
for the hybrid, preemption; prefix caching is off for both (the state layers), which the kit
checks instead of hits. Every run: the whole contract on Bamba (its Mamba layers are the same
mixer), Mamba2's log-probs and greedy tokens; slow: Mamba2's batch tests."""

import pytest

from engine.testing.models import ModelContract


class TestBamba(ModelContract):
    model_class = "engine_models_mamba_hybrid.bamba:BambaForCausalLM"


class TestMamba2(ModelContract):
    model_class = "engine_models_mamba_hybrid.mamba2:Mamba2ForCausalLM"

    @pytest.mark.slow  # Bamba's run puts the same mixer under batching, chunking and preemption
    def test_greedy_under_preemption_matches_transformers(self, checkpoints):
        super().test_greedy_under_preemption_matches_transformers(checkpoints)

    @pytest.mark.slow  # as above; prefix caching is off alike
    def test_greedy_with_prefix_caching_matches_transformers(self, checkpoints):
        super().test_greedy_with_prefix_caching_matches_transformers(checkpoints)
