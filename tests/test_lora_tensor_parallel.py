"""LoRA adapters at TP=2 (two gloo ranks, the ``mp`` executor): each rank holds its part of
every adapter — B's rows of its outputs in a column-parallel layer, A's columns of its inputs in
a row-parallel one, added before the all-reduce — and the ranks fill the same slots step after
step. The mixed batch of test_lora (base rows and four adapters interleaved, prompts split by
chunked prefill) gives ``transformers`` + ``peft``'s greedy tokens and prompt log-probs."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.testing import reference
from tests.test_lora import (
    ADAPTER_OF_PROMPT,
    LENGTHS,
    NEW_TOKENS,
    build_family,
    engine_prompt_logprobs,
    hf_prompt_logprobs,
    lora_llm,
)

pytest.importorskip("peft")


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_mixed_adapters_at_tp2_match_peft(name, tmp_path):
    base_folder, base, adapters = build_family(name, tmp_path)
    prompts = reference.random_prompts(256, LENGTHS, seed=5)
    requests = [None if i is None else adapters[i][0] for i in ADAPTER_OF_PROMPT]
    llm = lora_llm(
        base_folder, tensor_parallel_size=2, distributed_executor_backend="mp", max_num_batched_tokens=16
    )
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=0)
        outs = llm.generate(prompts, params, lora_request=requests)
    finally:
        llm.engine.shutdown()
    for prompt, lora_id, out in zip(prompts, ADAPTER_OF_PROMPT, outs):
        model = base if lora_id is None else adapters[lora_id][1]
        assert out.outputs[0].token_ids == reference.hf_greedy(model, [prompt], NEW_TOKENS)[0], (
            f"adapter {lora_id}"
        )
        torch.testing.assert_close(
            engine_prompt_logprobs(out), hf_prompt_logprobs(model, prompt), rtol=0, atol=2e-4
        )
