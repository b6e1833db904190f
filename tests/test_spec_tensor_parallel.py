"""Speculative decoding at TP=2 (two gloo ranks, the ``mp`` executor). The core drafts on rank 0
between steps; the drafts reach rank 1 as tokens of the next step's broadcast input, and only
rank 0 samples and verifies. Greedy output at TP=2 with speculation must equal TP=1 without it,
token for token, with drafts accepted on the way, and seeded sampling at TP=2 must draw what one
rank draws with the same drafter (the rejection sampler's randomness lives on rank 0 alone):
ngram (no model) and a separate draft model (built unsharded on rank 0); EAGLE and MTP, which
draft on every rank, are tested in spec-eagle and spec-mtp. Layer-skip self-drafting, which
would call the target's sharded layers from rank 0 alone, is refused by name."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.testing import reference
from engine.testing.spec import OPTIONS, TINY

# repetitive prompts, so the n-gram drafter finds matches, and random ones
PROMPTS = [
    [5, 6, 7, 8] * 6,
    [40, 41, 42] * 9,
    *reference.random_prompts(TINY["vocab_size"], [30, 12, 44, 3], seed=3),
]
PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SEEDED = [SamplingParams(max_tokens=16, temperature=0.8, seed=seed, ignore_eos=True) for seed in range(6)]
TP2 = dict(OPTIONS, tensor_parallel_size=2, distributed_executor_backend="mp")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("spec-tp-target"))
    reference.tiny_checkpoint(folder, "LlamaForCausalLM", TINY, seed=5)
    return folder


@pytest.fixture(scope="module")
def expected(target):
    """TP=1, no speculation: the tokens every TP=2 run with speculation must give."""
    llm = LLM(target, **OPTIONS)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize(
    "speculative_config",
    [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
        {"method": "draft_model", "num_speculative_tokens": 3, "model": "{target}"},
    ],
    ids=["ngram", "draft_model"],
)
def test_tp2_with_speculation_equals_tp1(speculative_config, target, expected):
    config = {k: v.format(target=target) if isinstance(v, str) else v for k, v in speculative_config.items()}
    sampled = []
    for options in (OPTIONS, TP2):
        llm = LLM(target, speculative_config=config, **options)
        try:
            greedy = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
            stats = llm.engine.stats()
            sampled.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, SEEDED)])
        finally:
            llm.engine.shutdown()
    assert greedy == expected, "greedy at TP=2 with speculation must equal TP=1 without"
    assert stats["spec_accepted_tokens"] > 0, "drafts must have been verified and accepted"
    assert sampled[1] == sampled[0], "seeded sampling at TP=2 must draw what one rank draws"


def test_self_drafting_on_sharded_layers_is_refused_by_name(target):
    refusal = "speculative decoding method 'draft_model' is not tensor-parallel yet"
    with pytest.raises(ValueError, match=refusal):
        LLM(target, speculative_config={"method": "draft_model", "self_draft_layers": 1}, **TP2)
