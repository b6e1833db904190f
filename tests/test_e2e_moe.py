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


@pytest.mark.slow  # ~3 engine runs of 40 prompts
def test_tiny_moe_is_batch_invariant_in_bf16(tmp_path):
    """Under batch_invariant a request's tokens and log-probs through the MoE layers are bit for
    bit the same alone, in a batch of 40, under ngram speculation, from the prefix cache and
    prefilled in chunks."""
    from engine import LLM
    from engine_models_moe.model import MoeForCausalLM
    from tests.test_batch_invariant import _differing, _runs

    kwargs = MoeForCausalLM.example_configs()["Qwen3MoeForCausalLM"]
    reference.tiny_checkpoint(str(tmp_path), "Qwen3MoeForCausalLM", kwargs, seed=5)
    prompts = reference.random_prompts(kwargs["vocab_size"], [8 + (i * 7) % 40 for i in range(40)], seed=6)

    def factory(**options):
        return LLM(
            str(tmp_path), dtype="bfloat16", num_blocks=512, block_size=16, batch_invariant=True, **options
        )

    assert not _differing(_runs(factory, prompts, [0, 13, 27, 39], 16))
