"""Acceptance for the MoE family: continuous batching with chunked prefill at a small token
budget and a KV pool small enough to force preemption gives, per prompt, exactly
transformers' greedy tokens, for each architecture models-moe serves."""

from __future__ import annotations

import pytest

from engine.testing import reference
from tests.test_e2e_parity import LENGTHS, run_squeezed


@pytest.mark.slow  # ~30 s each, most of it transformers' own generate
@pytest.mark.parametrize("config", ["MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"])
def test_tiny_moe_matches_transformers_under_preemption(config, tmp_path):
    from engine_models_moe.model import MoeForCausalLM

    kwargs = MoeForCausalLM.example_configs()[config]
    hf_model = reference.tiny_checkpoint(str(tmp_path), config, kwargs, seed=7)
    prompts = reference.random_prompts(hf_model.config.vocab_size, LENGTHS, seed=3)
    llm, got = run_squeezed(str(tmp_path), prompts, new_tokens=24)
    assert llm.engine.stats()["preemptions"] > 0, "the pool must be small enough to force preemption"
    assert got == reference.hf_greedy(hf_model, prompts, 24)
