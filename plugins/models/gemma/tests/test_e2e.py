"""End to end: greedy ``LLM.generate`` on tiny random Gemma 2 and Gemma 3 checkpoints equals
``transformers`` token for token — mixed prompts, most longer than the 16-token window, under
continuous batching with 24-token prefill chunks and a KV pool small enough to preempt, and with
a shared prefix that the prefix cache serves."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.testing import reference
from engine_models_gemma.model import GemmaForCausalLM

LENGTHS = [3, 41, 17, 8, 60, 25, 5, 33, 12, 50]
SHARED_PREFIX = 37


@pytest.fixture(scope="module", params=["Gemma2ForCausalLM-untied-mha", "Gemma3ForCausalLM-untied"])
def checkpoint(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(request.param))
    kwargs = GemmaForCausalLM.example_configs()[request.param]
    return folder, reference.tiny_checkpoint(folder, request.param.split("-")[0], kwargs)


def prompts_for(vocab_size: int) -> list[list[int]]:
    prompts = reference.random_prompts(vocab_size, LENGTHS, seed=3)
    prefix = prompts[4][:SHARED_PREFIX]
    return prompts + [prefix + tail for tail in reference.random_prompts(vocab_size, [4, 11], seed=4)]


@pytest.mark.slow
def test_greedy_matches_transformers_under_preemption_and_prefix_caching(checkpoint):
    folder, hf_model = checkpoint
    prompts = prompts_for(hf_model.config.vocab_size)
    llm = LLM(folder, dtype="float32", max_num_batched_tokens=24, max_num_seqs=6, block_size=8, num_blocks=20,
              max_model_len=128, enable_prefix_caching=True)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    stats = llm.engine.stats()
    assert stats["preemptions"] > 0, "the pool must be small enough to force preemption"
    assert stats["prefix_hits"] > 0, "the shared prefix must be served from the cache"
    assert [o.outputs[0].token_ids for o in outs] == reference.hf_greedy(hf_model, prompts, 16)
