"""The experts go through the quant method: a tiny Mixtral under online int8 keeps every
expert in int8 and stays within int8 rounding of transformers' float32 log-probs."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.moe import ExpertLinear
from engine.testing import reference
from engine_models_moe.model import MoeForCausalLM


@pytest.mark.slow  # ~20 s each on the shared machine
@pytest.mark.parametrize("method", ["int8-w8a16", "int8-w8a8"])
def test_int8_experts_stay_close_to_float(method, tmp_path):
    config = MoeForCausalLM.example_configs()["MixtralForCausalLM"] | dict(initializer_range=0.05)
    hf_model = reference.tiny_checkpoint(str(tmp_path), "MixtralForCausalLM", config, seed=2)
    llm = LLM(
        str(tmp_path), dtype="float32", quantization=method, num_blocks=40, block_size=8, max_model_len=64
    )
    experts = [m for m in llm.engine.model.modules() if isinstance(m, ExpertLinear)]
    assert experts and all(type(m.method).name == method and len(m.int8_experts) == 4 for m in experts)
    prompts = reference.random_prompts(config["vocab_size"], [7, 19], seed=4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=-1, temperature=0))
    for ids, out in zip(prompts, outs):
        want = reference.hf_logprobs(hf_model, ids)[:-1]
        got = torch.tensor(
            [[entry[t].logprob for t in range(len(entry))] for entry in out.prompt_logprobs[1:]]
        )
        assert (got - want).abs().mean() < 0.01  # measured 0.0034 (w8a16), 0.0038 (w8a8); float32 ~1e-6
