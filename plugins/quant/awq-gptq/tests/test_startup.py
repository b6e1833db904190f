"""Starting an engine on AWQ/GPTQ checkpoints: named as vLLM command lines name them
(``--quantization awq``) or not, they load; bad ones are refused at start-up, each with one
line naming what is wrong (real checkpoint folders whose ``quantization_config`` was edited)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from engine import LLM, SamplingParams
from engine.testing import reference
from engine.testing.quant import TINY_LLAMA, write_quantized_checkpoint
from engine_quant_awq_gptq import checkpoint

AWQ = checkpoint.awq_config(32)
GPTQ = checkpoint.gptq_config(4, 32)


def _without(config: dict, key: str) -> dict:
    return {k: v for k, v in config.items() if k != key}


BAD_CONFIGS = {
    "awq without group_size": (AWQ, _without(AWQ, "group_size"), "awq quantization_config lacks group_size"),
    "awq without bits": (AWQ, _without(AWQ, "bits"), "awq quantization_config lacks bits"),
    "awq gemv": (AWQ, AWQ | {"version": "gemv"}, "awq version 'gemv' is not supported"),
    "awq 8-bit": (AWQ, AWQ | {"bits": 8}, "awq bits 8 is not supported"),
    "awq no zero point": (AWQ, AWQ | {"zero_point": False}, "awq zero_point false"),
    "gptq without bits": (GPTQ, _without(GPTQ, "bits"), "gptq quantization_config lacks bits"),
    "gptq 3-bit": (GPTQ, GPTQ | {"bits": 3}, "gptq bits 3 is not supported"),
    "gptq bits as text": (GPTQ, GPTQ | {"bits": "4"}, "gptq bits must be an integer"),
    "gptq unknown format": (
        GPTQ,
        GPTQ | {"checkpoint_format": "marlin"},
        "gptq checkpoint_format 'marlin' is not supported",
    ),
    "gptq group not dividing the inputs": (GPTQ, GPTQ | {"group_size": 96}, "group_size 96 does not divide"),
    "tensors of another group size": (GPTQ, GPTQ | {"group_size": 64}, "gptq qzeros has shape"),
}
COMMON = dict(dtype="float32", num_blocks=40, block_size=8, max_model_len=128)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{quant method: a tiny checkpoint folder packed as its config declares}."""
    hf_folder = str(tmp_path_factory.mktemp("hf"))
    reference.tiny_checkpoint(hf_folder, "LlamaForCausalLM", TINY_LLAMA, seed=4)
    written = {}
    for name, config, quantize in (
        ("awq", AWQ, lambda w: checkpoint.awq_tensors(w, 32)),
        ("gptq", GPTQ, lambda w: checkpoint.gptq_tensors(w, 4, 32)),
    ):
        written[name] = str(tmp_path_factory.mktemp(name))
        write_quantized_checkpoint(hf_folder, written[name], quantize, config)
    return written


def _edited(source: str, folder: str, quantization_config: dict) -> str:
    shutil.copytree(source, folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_naming_the_checkpoints_method_serves_it_as_declared(method, folders):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    named, declared = (LLM(folders[method], **kwargs, **COMMON) for kwargs in ({"quantization": method}, {}))
    prompt = [[5, 17, 99, 3]]
    assert (
        named.generate(prompt, params)[0].outputs[0].token_ids
        == declared.generate(prompt, params)[0].outputs[0].token_ids
    )


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_checkpoint_is_refused_naming_it(case, folders, tmp_path):
    packed_as, bad, message = BAD_CONFIGS[case]
    folder = _edited(folders[packed_as["quant_method"]], str(tmp_path / "bad"), bad)
    with pytest.raises(ValueError) as refused:
        LLM(folder, **COMMON)
    assert message in str(refused.value) and "\n" not in str(refused.value)
