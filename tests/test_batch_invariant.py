"""Batch-invariant mode: a request's greedy tokens and log-probs are bit for bit the same
alone, inside a batch of many, and under ngram speculation."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}


def _prompts(tokenizer, count: int) -> list[list[int]]:
    words = [
        "the",
        "cat",
        "sat",
        "on",
        "the",
        "mat",
        "and",
        "the",
        "dog",
        "sat",
        "on",
        "the",
        "log",
        "while",
        "the",
        "bird",
        "sang",
    ]
    return [
        tokenizer.encode(" ".join(words[(i + j) % len(words)] for j in range(8 + (i * 7) % 40)))
        for i in range(count)
    ]


def _runs(llm_factory, prompts, targets, max_tokens):
    """(alone, batched, speculative): per target, (token ids, chosen-token logprobs)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)

    def seen(outputs):
        return [
            (o.outputs[0].token_ids, [next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
            for o in outputs
        ]

    llm = llm_factory()
    alone = [seen(llm.generate([prompts[t]], params))[0] for t in targets]
    batched = seen(llm.generate(prompts, params))
    spec = seen(llm_factory(speculative_config=NGRAM).generate(prompts, params))
    return alone, [batched[t] for t in targets], [spec[t] for t in targets]


@pytest.fixture(scope="module")
def tiny_prompts(default_tokenizer):
    return _prompts(default_tokenizer, 40)


def test_tiny_model_is_batch_invariant_in_bf16(tiny_llama, tiny_prompts):
    targets = [0, 13, 27, 39]

    def factory(**options):
        return LLM(tiny_llama[0], dtype="bfloat16", num_blocks=512, batch_invariant=True, **options)

    alone, batched, spec = _runs(factory, tiny_prompts, targets, 24)
    assert alone == batched == spec  # tokens and log-probs, bit for bit


def test_the_check_sees_batch_effects_without_the_mode(tiny_llama, tiny_prompts):
    """Without the mode the same comparison finds log-probs that differ: the test above is
    not passing because batches never matter."""
    targets = [0, 13, 27, 39]

    def factory(**options):
        return LLM(tiny_llama[0], dtype="bfloat16", num_blocks=512, **options)

    alone, batched, spec = _runs(factory, tiny_prompts, targets, 24)
    assert alone != batched or alone != spec


def test_batch_invariant_turns_off_chunking_and_prefix_caching(tiny_llama):
    llm = LLM(tiny_llama[0], dtype="float32", num_blocks=64, batch_invariant=True, max_num_batched_tokens=64)
    config = llm.engine.config
    assert config.batch_invariant and not config.cache.enable_prefix_caching
    assert not config.scheduler.enable_chunked_prefill
    assert config.scheduler.max_num_batched_tokens == config.model.max_model_len  # a whole prompt per step


@pytest.mark.slow
def test_default_model_is_batch_invariant(default_tokenizer):
    """The acceptance case: the embedded default model (GGUF kept quantized, bf16 activations)."""
    prompts = _prompts(default_tokenizer, 64)
    alone, batched, spec = _runs(lambda **o: LLM(batch_invariant=True, **o), prompts, [5, 30, 63], 32)
    assert alone == batched == spec
