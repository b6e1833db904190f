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
    llm = LLM(
        folder,
        dtype="float32",
        max_num_batched_tokens=24,
        max_num_seqs=6,
        block_size=8,
        num_blocks=20,
        max_model_len=128,
        enable_prefix_caching=True,
    )
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    stats = llm.engine.stats()
    assert stats["preemptions"] > 0, "the pool must be small enough to force preemption"
    assert stats["prefix_hits"] > 0, "the shared prefix must be served from the cache"
    assert [o.outputs[0].token_ids for o in outs] == reference.hf_greedy(hf_model, prompts, 16)


@pytest.mark.parametrize("backend", ["torch", "cpu-native"])
def test_long_run_keeps_only_the_window_in_sliding_layers(checkpoint, backend):
    """Prompts of 6 × the 16-token window: the sliding-window layers' group holds the window's
    blocks and a chunk's, the full layers' group every block, the greedy tokens stay exact (with
    either attention backend reading tables whose passed entries are the null block), and the
    sliding layers' caches are allocated for what the window needs, not the pool's size."""
    folder, hf_model = checkpoint
    window, block_size, new_tokens = hf_model.config.sliding_window, 8, 16
    prompts = reference.random_prompts(hf_model.config.vocab_size, [6 * window, 6 * window + 5], seed=5)
    llm = LLM(
        folder,
        dtype="float32",
        max_num_batched_tokens=24,
        max_num_seqs=2,
        block_size=block_size,
        num_blocks=64,
        max_model_len=128,
        attention_backend=backend,
    )
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == reference.hf_greedy(hf_model, prompts, new_tokens)

    engine = llm.engine
    full, sliding = engine.kv_groups
    assert full.sliding_window is None and sliding.sliding_window == window
    full_peak, sliding_peak = engine.kv_cache_manager.peak_blocks_in_use()
    longest = -(-(len(prompts[1]) + new_tokens - 1) // block_size)  # the last sampled token has no KV
    per_request = -(-(window - 1 + 24) // block_size) + 1  # the window and one prefill chunk
    assert full_peak >= longest
    assert sliding_peak <= 2 * per_request < full_peak / 2
    assert engine.kv_cache_manager.stats["window_freed_blocks"] >= 2 * (longest - 1 - per_request)
    sliding_cache = engine.runner.kv_caches[sliding.layers[0]]
    assert sliding.num_blocks < full.num_blocks == 64
    assert sliding_cache.shape[engine.attention.block_dim] == sliding.num_blocks


def test_speculative_decoding_is_refused_with_the_reason(checkpoint):
    folder, _ = checkpoint
    with pytest.raises(ValueError, match="speculative_config: not supported for a model whose layers attend"):
        LLM(
            folder,
            dtype="float32",
            num_blocks=64,
            block_size=8,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
