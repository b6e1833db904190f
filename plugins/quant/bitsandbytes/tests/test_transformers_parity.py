"""A tiny random Llama saved through transformers' ``BitsAndBytesConfig`` (4-bit NF4 with double
quantization, FP4, 8-bit), served by the engine on the plain ``cpu`` platform:

- in float32, its log-probabilities equal ``transformers`` running the same weights as
  bitsandbytes dequantizes them (within float tolerance): the format read exactly;
- its greedy tokens equal ``transformers`` serving the checkpoint itself through bitsandbytes'
  CPU backend (whose 8-bit matmul rounds activations to int8, where ours keeps them: the tokens
  agree on this model, the log-probabilities only within that rounding). Both in float32: in
  bfloat16 one of these random prompts is a near tie that the two attention implementations'
  roundings break differently."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.testing import reference
from engine.testing.quant import TINY_LLAMA, prompt_logprobs
from engine_quant_bitsandbytes.checkpoint import MODES, dequantized_reference, save_quantized

pytest.importorskip("bitsandbytes", reason="bitsandbytes (the test extra) makes these checkpoints")

COMMON = dict(num_blocks=40, block_size=8, max_model_len=128, device="cpu")
PROMPTS = reference.random_prompts(TINY_LLAMA["vocab_size"], [9, 23], seed=5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("hf"))
    return folder, reference.tiny_checkpoint(folder, "LlamaForCausalLM", TINY_LLAMA, seed=4)


@pytest.fixture(scope="module", params=list(MODES))
def saved(request, tiny, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(request.param))
    save_quantized(tiny[0], folder, request.param)
    return request.param, folder


def test_the_format_reads_exactly_as_bitsandbytes_dequantizes_it(saved, tiny):
    folder = saved[1]
    hf_model = dequantized_reference(tiny[1], folder)
    llm = LLM(folder, dtype="float32", **COMMON)
    for ids, got in zip(PROMPTS, prompt_logprobs(llm, PROMPTS)):
        torch.testing.assert_close(got, reference.hf_logprobs(hf_model, ids)[:-1], atol=2e-3, rtol=1e-3)


def test_greedy_tokens_equal_transformers_serving_the_checkpoint(saved):
    from transformers import AutoModelForCausalLM

    folder = saved[1]
    hf_model = AutoModelForCausalLM.from_pretrained(folder, device_map="cpu", dtype=torch.float32).eval()
    llm = LLM(folder, dtype="float32", **COMMON)
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in greedy] == reference.hf_greedy(hf_model, PROMPTS, 8)
