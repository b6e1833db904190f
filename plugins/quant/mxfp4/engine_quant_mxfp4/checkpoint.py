"""Writing MXFP4 checkpoints (tests, benchmarks): the linear weights of a float safetensors
folder as ``weight_blocks``/``weight_scales`` and ``quantization_config`` ``mxfp4``."""

from __future__ import annotations

import json
import os
import shutil

from safetensors.torch import load_file, save_file

from engine_quant_mxfp4.format import quantize

LINEAR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                   "gate_proj.weight", "up_proj.weight", "down_proj.weight")


def write_mxfp4_checkpoint(source: str, folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    tensors = {}
    for name in sorted(f for f in os.listdir(source) if f.endswith(".safetensors")):
        for key, value in load_file(os.path.join(source, name)).items():
            if key.endswith(LINEAR_SUFFIXES):
                blocks, scales = quantize(value)
                tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
            else:
                tensors[key] = value
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    for name in os.listdir(source):
        if not name.endswith(".safetensors") and os.path.isfile(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4"}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
