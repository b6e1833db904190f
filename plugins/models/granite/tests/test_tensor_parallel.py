"""Granite on two tensor-parallel ranks (``mp``): each rank scales its own heads' queries by
the attention multiplier and the reduced block outputs by the residual multiplier; greedy
tokens equal transformers'."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.testing import reference
from engine_models_granite.model import GraniteForCausalLM


@pytest.mark.slow  # a worker process's start and a second engine
def test_two_ranks_give_transformers_greedy_tokens(tmp_path):
    kwargs = GraniteForCausalLM.example_configs()["GraniteForCausalLM"]
    hf_model = reference.tiny_checkpoint(str(tmp_path), "GraniteForCausalLM", kwargs)
    prompts = reference.random_prompts(kwargs["vocab_size"], [5, 19, 2, 33], seed=7)
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        num_blocks=40,
        block_size=8,
        max_model_len=64,
    )
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    finally:
        llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == reference.hf_greedy(hf_model, prompts, 12)
