"""A tiny random Qwen3-MoE written as a W4A16 compressed-tensors checkpoint, experts included,
served by the engine against the same model with every weight replaced by its plain
dequantization (:mod:`engine_quant_compressed_tensors.checkpoint`) and served unquantized:
float32 on the plain ``cpu`` platform, the same log-probabilities within float tolerance and
the same greedy tokens. (The kit's expert checks, per scheme: ``test_conformance.py``.)"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.testing import reference
from engine.testing.quant import prompt_logprobs, write_quantized_checkpoint
from engine_quant_compressed_tensors import checkpoint

W4A16 = checkpoint.config("pack-quantized", checkpoint.int_weights(4, 16))
COMMON = dict(dtype="float32", device="cpu", num_blocks=40, block_size=8, max_model_len=128)


def _quantize(weight: torch.Tensor) -> dict:
    return checkpoint.packed_tensors(weight, 4, 16)


def _dequantized(weight: torch.Tensor) -> torch.Tensor:
    return checkpoint.dequantize_packed(_quantize(weight), 4)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the quantized checkpoint's engine, its plain dequantization's engine)."""
    from engine_models_moe.model import MoeForCausalLM

    config = MoeForCausalLM.example_configs()["Qwen3MoeForCausalLM"]
    hf_folder = str(tmp_path_factory.mktemp("hf"))
    reference.tiny_checkpoint(hf_folder, "Qwen3MoeForCausalLM", config, seed=7)
    quantized, plain = (str(tmp_path_factory.mktemp(name)) for name in ("w4a16", "dequantized"))
    write_quantized_checkpoint(hf_folder, quantized, _quantize, W4A16)
    write_quantized_checkpoint(hf_folder, plain, lambda w: {"weight": _dequantized(w)}, None)
    return LLM(quantized, **COMMON), LLM(plain, **COMMON)


def test_quantized_experts_serve_their_dequantized_weights(served):
    quantized, plain = served
    experts = quantized.engine.model.model.layers[0].mlp.experts
    assert [type(part.method).__name__ for part in (experts.gate_up, experts.down)] == [
        "CompressedTensorsLinearMethod"
    ] * 2
    prompts = reference.random_prompts(256, [9, 23, 5], seed=5)
    for got, want in zip(prompt_logprobs(quantized, prompts), prompt_logprobs(plain, prompts)):
        torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    tokens = [[out.outputs[0].token_ids for out in llm.generate(prompts, greedy)] for llm in served]
    assert tokens[0] == tokens[1]
