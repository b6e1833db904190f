"""A tiny random Llama written as AWQ and GPTQ checkpoints, served by the engine, against
``transformers`` running the same checkpoint dequantized by plain torch
(:mod:`engine_quant_awq_gptq.checkpoint`'s reference dequantizers) in float32.

On the plain ``cpu`` platform (int4pack planes, exact in float32) the log-probabilities agree
within float tolerance and the greedy tokens are the same. On the best platform here (cpu-native's
packed kernel, which rounds activations to int8 per 32 inputs, as llama.cpp does) they agree
within that rounding."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.testing import reference
from engine.testing.quant import TINY_LLAMA, prompt_logprobs, write_quantized_checkpoint
from engine_quant_awq_gptq import checkpoint

FORMATS = {
    "awq-g32": (
        lambda w: checkpoint.awq_tensors(w, 32),
        lambda t: checkpoint.dequantize_awq(t, 32),
        checkpoint.awq_config(32),
    ),
    "awq-g128": (
        lambda w: checkpoint.awq_tensors(w, 128),
        lambda t: checkpoint.dequantize_awq(t, 128),
        checkpoint.awq_config(128),
    ),
    "gptq-4bit-asym-act-order-v1": (
        lambda w: checkpoint.gptq_tensors(w, 4, 64, sym=False, desc_act=True),
        lambda t: checkpoint.dequantize_gptq(t, 4),
        checkpoint.gptq_config(4, 64, sym=False, desc_act=True),
    ),
    "gptq-4bit-sym-v2": (
        lambda w: checkpoint.gptq_tensors(w, 4, 128, v2=True),
        lambda t: checkpoint.dequantize_gptq(t, 4, v2=True),
        checkpoint.gptq_config(4, 128, v2=True),
    ),
    "gptq-8bit-act-order": (
        lambda w: checkpoint.gptq_tensors(w, 8, 32, desc_act=True),
        lambda t: checkpoint.dequantize_gptq(t, 8),
        checkpoint.gptq_config(8, 32, desc_act=True),
    ),
    "awq-down-proj-not-converted": (  # down_proj, the only projection of 512 inputs, stays float
        lambda w: {"weight": w} if w.shape[1] == 512 else checkpoint.awq_tensors(w, 32),
        lambda t: t["weight"] if "weight" in t else checkpoint.dequantize_awq(t, 32),
        checkpoint.awq_config(32) | {"modules_to_not_convert": ["down_proj"]},
    ),
}
COMMON = dict(dtype="float32", num_blocks=40, block_size=8, max_model_len=128)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("hf"))
    return folder, reference.tiny_checkpoint(folder, "LlamaForCausalLM", TINY_LLAMA, seed=4)


def dequantized_reference(hf_model, quantize, dequantize):
    """``hf_model`` with every linear weight replaced by its checkpoint's plain dequantization."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_model.config, dtype=torch.float32).eval()
    state = hf_model.state_dict()
    for name, value in state.items():
        if name.endswith("_proj.weight"):
            state[name] = dequantize(quantize(value))
    model.load_state_dict(state)
    return model


@pytest.fixture(scope="module", params=list(FORMATS))
def served(request, tiny, tmp_path_factory):
    """(checkpoint folder, transformers model on its dequantized weights)."""
    quantize, dequantize, config = FORMATS[request.param]
    hf_folder, hf_model = tiny
    folder = str(tmp_path_factory.mktemp(request.param))
    write_quantized_checkpoint(hf_folder, folder, quantize, config)
    return folder, dequantized_reference(hf_model, quantize, dequantize)


PROMPTS = reference.random_prompts(TINY_LLAMA["vocab_size"], [9, 23], seed=5)


def test_exact_path_equals_transformers_on_the_dequantized_checkpoint(served):
    folder, hf_model = served
    llm = LLM(folder, device="cpu", **COMMON)
    for ids, got in zip(PROMPTS, prompt_logprobs(llm, PROMPTS)):
        want = reference.hf_logprobs(hf_model, ids)[:-1]
        torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in greedy] == reference.hf_greedy(hf_model, PROMPTS, 12)


def test_packed_kernel_is_within_its_activation_rounding(served):
    folder, hf_model = served
    for ids, got in zip(PROMPTS, prompt_logprobs(LLM(folder, **COMMON), PROMPTS)):
        want = reference.hf_logprobs(hf_model, ids)[:-1]
        assert (got - want).abs().mean() <= 0.02
