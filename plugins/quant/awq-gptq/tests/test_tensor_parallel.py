"""AWQ and GPTQ under tensor parallelism: two gloo ranks (the ``mp`` executor: this process is
rank 0) against one, float32 activations on the plain ``cpu`` platform, on a tiny random Llama
written in each format.

Each rank reads its part of the checkpoint's own tensors — packed words, scales and zero points
cut along the outputs (column-parallel: q/k/v, gate/up) or along the inputs in whole words and
groups (row-parallel: o_proj, down_proj), GPTQ's scales and zero points whole on a row-parallel
rank with its part of ``g_idx`` — so its weights are exactly TP=1's, and TP=2 greedy is TP=1
greedy. A row-parallel rank whose act-order inputs leave groups partly on the other rank is
dequantized at load. A split that would cut a group or a packing word is refused at start-up,
naming the rank's sizes.
"""

from __future__ import annotations

import re

import pytest
import torch

from engine import LLM, SamplingParams
from engine.testing import reference
from engine.testing.quant import TINY_LLAMA, write_quantized_checkpoint
from engine_quant_awq_gptq import checkpoint

FORMATS = {
    "awq-g32": (lambda w: checkpoint.awq_tensors(w, 32), checkpoint.awq_config(32)),
    "awq-g128": (lambda w: checkpoint.awq_tensors(w, 128), checkpoint.awq_config(128)),
    "gptq-4bit-sym-g32-v1": (lambda w: checkpoint.gptq_tensors(w, 4, 32), checkpoint.gptq_config(4, 32)),
    "gptq-4bit-asym-g64-v2": (
        lambda w: checkpoint.gptq_tensors(w, 4, 64, sym=False, v2=True),
        checkpoint.gptq_config(4, 64, sym=False, v2=True),
    ),
    "gptq-8bit-asym-g32-v1": (
        lambda w: checkpoint.gptq_tensors(w, 8, 32, sym=False),
        checkpoint.gptq_config(8, 32, sym=False),
    ),
    "gptq-8bit-channelwise": (  # group_size -1: one scale a row, whole on every rank
        lambda w: checkpoint.gptq_tensors(w, 8, w.shape[1]),
        checkpoint.gptq_config(8, -1),
    ),
    "gptq-4bit-asym-act-order-v1": (
        lambda w: checkpoint.gptq_tensors(w, 4, 32, sym=False, desc_act=True),
        checkpoint.gptq_config(4, 32, sym=False, desc_act=True),
    ),
}
COMMON = dict(dtype="float32", device="cpu", num_blocks=40, block_size=8, max_model_len=128)
TP2 = dict(tensor_parallel_size=2, distributed_executor_backend="mp")
PROMPTS = reference.random_prompts(TINY_LLAMA["vocab_size"], [9, 23, 4, 31], seed=5)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
QKV, DOWN = "model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.down_proj"


def _checkpoint(tmp_path_factory, config: dict) -> str:
    folder = str(tmp_path_factory.mktemp("hf"))
    reference.tiny_checkpoint(folder, "LlamaForCausalLM", config, seed=4)
    return folder


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return _checkpoint(tmp_path_factory, TINY_LLAMA)


def _greedy(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]


def _layer(llm: LLM, path: str):
    return llm.engine.model.get_submodule(path)


def _weight(llm: LLM, path: str) -> torch.Tensor:
    layer = _layer(llm, path)
    return layer.method.dequantize(layer)


def _rank0_part_of(one: LLM, two: LLM) -> None:
    """Rank 0's dequantized weights are its part of TP=1's, bit for bit: the first of the two
    kv heads' rows of q, k and v, the first half of down_proj's columns."""
    q, k, v = _weight(one, QKV).split([256, 128, 128])
    torch.testing.assert_close(_weight(two, QKV), torch.cat([q[:128], k[:64], v[:64]]), rtol=0, atol=0)
    torch.testing.assert_close(_weight(two, DOWN), _weight(one, DOWN)[:, :256], rtol=0, atol=0)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_tp2_greedy_equals_tp1_each_rank_holding_its_part(hf_folder, tmp_path, fmt):
    quantize, config = FORMATS[fmt]
    write_quantized_checkpoint(hf_folder, str(tmp_path), quantize, config)
    one = LLM(str(tmp_path), **COMMON)
    two = LLM(str(tmp_path), **TP2, **COMMON)
    try:
        _rank0_part_of(one, two)
        if config.get("desc_act"):  # act-order: the rank's inputs hold parts of groups
            assert _layer(two, DOWN).kernel_path == "dense" and _layer(two, QKV).kernel_path != "dense"
        else:
            assert _layer(two, DOWN).kernel_path == _layer(one, DOWN).kernel_path
        assert _greedy(two) == _greedy(one)
    finally:
        two.engine.shutdown()


REFUSED = {  # TP=1 checkpoints whose groups or words a split over 2 ranks would cut
    "awq group 256 against o_proj's 128 columns a rank": (
        TINY_LLAMA,
        lambda w: checkpoint.awq_tensors(w, 256),
        checkpoint.awq_config(256),
        "awq group_size 256 does not divide a layer's input size 128 (a tensor-parallel rank's part",
    ),
    "gptq 4-bit words against gate/up's 260 rows a rank": (
        TINY_LLAMA | {"intermediate_size": 520},
        lambda w: checkpoint.gptq_tensors(w, 4, w.shape[1]),
        checkpoint.gptq_config(4, -1),
        (
            "gptq packs 8 values a word; output sizes [260, 260] (a tensor-parallel rank's part "
            "of a layer) do not hold whole words"
        ),
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_split_cutting_a_group_or_word_is_refused_naming_it(tmp_path_factory, tmp_path, case):
    model_config, quantize, config, message = REFUSED[case]
    write_quantized_checkpoint(_checkpoint(tmp_path_factory, model_config), str(tmp_path), quantize, config)
    LLM(str(tmp_path), **COMMON).engine.shutdown()  # one rank holds whole groups and words
    with pytest.raises(ValueError, match=re.escape(f"quantization: {message}")) as refused:
        LLM(str(tmp_path), **TP2, **COMMON)
    assert "\n" not in str(refused.value)
