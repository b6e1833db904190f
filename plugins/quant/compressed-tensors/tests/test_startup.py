"""Starting an engine on compressed-tensors checkpoints: bad ones are refused at start-up, each
with one line naming what is wrong (a real checkpoint folder whose ``quantization_config`` was
edited); ``engine plugins`` names the path. (Splits tensor parallelism cannot make:
``test_tensor_parallel.py``.)"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from engine import LLM
from engine.testing import reference, select_platform
from engine.testing.quant import TINY_LLAMA, write_quantized_checkpoint
from engine_quant_compressed_tensors import checkpoint
from engine_quant_compressed_tensors.method import CompressedTensorsLinearMethod

W4A16 = checkpoint.config("pack-quantized", checkpoint.int_weights(4, 32))
GROUP = W4A16["config_groups"]["group_0"]


def _weights(**changes) -> dict:
    return W4A16 | {"config_groups": {"group_0": GROUP | {"weights": GROUP["weights"] | changes}}}


def _groups(targets_0: list[str], targets_1: list[str]) -> dict:
    """Two config groups of different schemes (8-bit weights the second's), targeting these."""
    other = GROUP["weights"] | {"num_bits": 8}
    groups = {
        "group_0": GROUP | {"targets": targets_0},
        "group_1": GROUP | {"targets": targets_1, "weights": other},
    }
    return W4A16 | {"config_groups": groups}


BAD_CONFIGS = {
    "no config groups": (W4A16 | {"config_groups": None}, "config_groups must name at least one group"),
    "bits as text": (_weights(num_bits="4"), "config_groups.group_0.weights.num_bits must be int"),
    "3-bit": (_weights(num_bits=3), "pack-quantized holds int weights of (4, 8) bits, not int of 3"),
    "unknown format": (W4A16 | {"format": "marlin-24"}, "format 'marlin-24' is not supported"),
    "group not dividing the inputs": (_weights(group_size=96), "group_size 96 does not divide"),
    "tensors of another group size": (_weights(group_size=64), "weight_scale has shape (256, 8)"),
    "act-order groups": (_weights(actorder="group"), "actorder 'group' is not supported"),
    "ignore not a list": (W4A16 | {"ignore": "lm_head"}, "ignore must be a list of module names"),
    "ignore entry naming no module": (
        W4A16 | {"ignore": ["lm_head", "model.layers.0.mlp.gate"]},
        "ignore entry 'model.layers.0.mlp.gate' names no module of the checkpoint",
    ),
    "ignore pattern matching nothing": (
        W4A16 | {"ignore": ["re:.*vision_tower.*"]},
        "ignore entry 're:.*vision_tower.*' names no module of the checkpoint",
    ),
    "ignore pattern malformed": (W4A16 | {"ignore": ["re:(mlp"]}, "ignore entry 're:(mlp' is not a regular"),
    "one target in groups of different schemes": (
        W4A16
        | {
            "config_groups": {
                "group_0": GROUP,
                "group_1": GROUP | {"weights": GROUP["weights"] | {"group_size": 64}},
            }
        },
        "config_groups 'group_0' and 'group_1' both target 'Linear' with different schemes",
    ),
    "target pattern malformed": (
        W4A16 | {"config_groups": {"group_0": GROUP | {"targets": ["re:(attn"]}}},
        "config_groups.group_0.targets entry 're:(attn' is not a regular expression",
    ),
    "fused projections in groups of different schemes": (
        _groups(["Linear"], ["re:.*q_proj$"]),
        "fall in config_groups ['group_0', 'group_1'] of different schemes",
    ),
    "a module no group targets": (
        _groups(["re:.*self_attn.*"], ["re:.*gate_proj$", "re:.*up_proj$"]),
        "down_proj' holds weight_",
    ),
}
COMMON = dict(dtype="float32", device="cpu", num_blocks=40, block_size=8, max_model_len=128)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    hf_folder = str(tmp_path_factory.mktemp("hf"))
    reference.tiny_checkpoint(hf_folder, "LlamaForCausalLM", TINY_LLAMA, seed=4)
    written = str(tmp_path_factory.mktemp("w4a16"))
    write_quantized_checkpoint(hf_folder, written, lambda w: checkpoint.packed_tensors(w, 4, 32), W4A16)
    return written


def _edited(folder: str, tmp_path, quantization_config: dict) -> str:
    copy = str(tmp_path / "edited")
    shutil.copytree(folder, copy)
    path = os.path.join(copy, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(path, "w") as f:
        json.dump(config, f)
    return copy


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_checkpoints_are_refused_in_one_line_naming_the_problem(folder, tmp_path, case):
    config, message = BAD_CONFIGS[case]
    with pytest.raises(ValueError) as refused:
        LLM(_edited(folder, tmp_path, config), **COMMON)
    text = str(refused.value)
    assert message in text and "\n" not in text and text.startswith("quantization: compressed-tensors")


def test_describe_names_each_schemes_path():
    text = CompressedTensorsLinearMethod.describe(select_platform("cpu"))
    assert "pack-quantized and weight-only int: int4pack planes" in text
    assert "NVFP4: dequantized at load" in text
    native = CompressedTensorsLinearMethod.describe(select_platform("cpu-native"))
    assert "NVFP4: the platform's FP4 kernel" in native
