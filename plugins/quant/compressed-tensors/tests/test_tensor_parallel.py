"""compressed-tensors under tensor parallelism: two gloo ranks (the ``mp`` executor: this
process is rank 0) against one, float32 activations on the plain ``cpu`` platform, on a tiny
random Llama written in each scheme (and in two: attention and MLP in config groups of
different schemes).

Each rank reads its part of the checkpoint's own tensors — packed words and group scales and
zero points cut along the rows (column-parallel) or along the columns in whole words and
groups (row-parallel), per-tensor scales whole — so its weights are exactly TP=1's, and TP=2
greedy is TP=1 greedy. Activations the checkpoint quantizes are rounded as at one rank: static
W8A8 elementwise by the one input scale, NVFP4 per 16 inputs (a rank's columns are whole
blocks), dynamic W8A8 per token over the rank's own columns (a scale never coarser than the
whole row's). A split that would cut a group or an FP8 block across the ranks is refused at
start-up, naming it.
"""

from __future__ import annotations

import re

import pytest
import torch

from engine import LLM, SamplingParams
from engine.testing import reference
from engine.testing.quant import TINY_LLAMA, write_quantized_checkpoint
from engine_quant_compressed_tensors import checkpoint

# four kv heads: each rank's k and v hold 128 rows, whole 128x128 FP8 blocks
CONFIG = TINY_LLAMA | {"num_key_value_heads": 4}
SCHEMES = {
    # two config groups: the MLP's weights, alone with 512 rows or inputs, W8A16 channel
    "w4a16-asymmetric-group32-attention-w8a16-channel-mlp": (
        lambda w: (
            checkpoint.packed_tensors(w, 8, None)
            if 512 in w.shape
            else checkpoint.packed_tensors(w, 4, 32, symmetric=False)
        ),
        checkpoint.mixed_config(
            {
                "attention": checkpoint.group(
                    "pack-quantized",
                    checkpoint.int_weights(4, 32, symmetric=False),
                    targets=[r"re:.*self_attn\..*_proj$"],
                ),
                "mlp": checkpoint.group(
                    "pack-quantized", checkpoint.int_weights(8, None), targets=[r"re:.*mlp\."]
                ),
            }
        ),
    ),
    "w8a8-static": (
        lambda w: checkpoint.int8_tensors(w, (2 + w.shape[0] / 128) / 127),
        checkpoint.config(
            "int-quantized", checkpoint.int_weights(8, None), checkpoint.activations("int", dynamic=False)
        ),
    ),
    "w8a8-dynamic": (
        checkpoint.int8_tensors,
        checkpoint.config(
            "int-quantized", checkpoint.int_weights(8, None), checkpoint.activations("int", dynamic=True)
        ),
    ),
    "fp8-block": (
        lambda w: checkpoint.fp8_tensors(w, "block"),
        checkpoint.config("float-quantized", checkpoint.float_weights("block")),
    ),
    "nvfp4-w4a4": (
        lambda w: checkpoint.nvfp4_tensors(w, 448 * 6 / (2 + w.shape[0] / 128)),
        checkpoint.config("nvfp4-pack-quantized", checkpoint.NVFP4_WEIGHTS, checkpoint.NVFP4_ACTIVATIONS),
    ),
}
REFUSED = {  # a TP=1 checkpoint whose groups or blocks a split over 2 ranks would cut
    "group 256 against o_proj's 128 columns a rank": (
        lambda w: checkpoint.packed_tensors(w, 4, 256),
        checkpoint.config("pack-quantized", checkpoint.int_weights(4, 256)),
        "group_size 256 does not divide a layer's input size 128 (a tensor-parallel rank's part",
    ),
    "256x256 FP8 blocks against k/v's 128 rows a rank": (
        lambda w: checkpoint.fp8_tensors(w, "block", 256),
        checkpoint.config("float-quantized", checkpoint.float_weights("block", 256)),
        (
            "FP8 blocks of 256x256 would straddle tensor-parallel ranks: "
            "a rank holds output sizes [128, 128, 128]"
        ),
    ),
}
COMMON = dict(dtype="float32", device="cpu", num_blocks=40, block_size=8, max_model_len=128)
PROMPTS = reference.random_prompts(CONFIG["vocab_size"], [9, 23, 4, 31], seed=5)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("hf"))
    reference.tiny_checkpoint(folder, "LlamaForCausalLM", CONFIG, seed=4)
    return folder


def _greedy(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]


def _weight(llm: LLM, path: str) -> torch.Tensor:
    layer = llm.engine.model.get_submodule(path)
    return layer.method.dequantize(layer)


def _rank0_part_of(one: LLM, two: LLM) -> None:
    """Rank 0's dequantized weights are its part of TP=1's, bit for bit: the first half of
    each of q, k and v's rows, the first half of down_proj's columns."""
    qkv, down = "model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.down_proj"
    q, k, v = _weight(one, qkv).split([256, 256, 256])
    torch.testing.assert_close(_weight(two, qkv), torch.cat([q[:128], k[:128], v[:128]]), rtol=0, atol=0)
    torch.testing.assert_close(_weight(two, down), _weight(one, down)[:, :256], rtol=0, atol=0)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_tp2_greedy_equals_tp1_each_rank_holding_its_part(hf_folder, tmp_path, scheme):
    quantize, config = SCHEMES[scheme]
    write_quantized_checkpoint(hf_folder, str(tmp_path), quantize, config)
    one = LLM(str(tmp_path), **COMMON)
    two = LLM(str(tmp_path), tensor_parallel_size=2, distributed_executor_backend="mp", **COMMON)
    try:
        _rank0_part_of(one, two)
        assert _greedy(two) == _greedy(one)
    finally:
        two.engine.shutdown()


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_split_cutting_a_group_or_block_is_refused_naming_it(hf_folder, tmp_path, case):
    quantize, config, message = REFUSED[case]
    write_quantized_checkpoint(hf_folder, str(tmp_path), quantize, config)
    with pytest.raises(ValueError, match=re.escape(f"quantization: compressed-tensors {message}")) as refused:
        LLM(str(tmp_path), tensor_parallel_size=2, distributed_executor_backend="mp", **COMMON)
    assert "\n" not in str(refused.value)
