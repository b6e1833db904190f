"""Writing FP8 checkpoints in the Hugging Face ``fp8`` layout (tests, benchmarks): the
linear weights of a float safetensors folder as e4m3 with per-tensor, per-channel or
128×128 block scales, and the ``quantization_config`` a real checkpoint carries."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
LINEAR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                   "gate_proj.weight", "up_proj.weight", "down_proj.weight")


def quantize(weight: torch.Tensor, scheme: str, block: int = 128) -> dict[str, torch.Tensor]:
    """-> {"weight": e4m3, "weight_scale" or "weight_scale_inv": float32} for one weight."""
    w = weight.float()
    if scheme == "tensor":
        scale = w.abs().max().clamp(min=1e-12) / FP8_MAX
        return {"weight": (w / scale).to(FP8), "weight_scale": scale.reshape(())}
    if scheme == "channel":
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        return {"weight": (w / scale).to(FP8), "weight_scale": scale}
    rows, cols = w.shape
    padded = torch.nn.functional.pad(w, (0, -cols % block, 0, -rows % block))
    tiles = padded.view(padded.shape[0] // block, block, padded.shape[1] // block, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).view_as(padded)[:rows, :cols]
    return {"weight": q.to(FP8), "weight_scale_inv": scale}


def dequantize(tensors: dict[str, torch.Tensor], block: int = 128) -> torch.Tensor:
    """Plain math back to float32."""
    q = tensors["weight"].float()
    if "weight_scale" in tensors:
        return q * tensors["weight_scale"].float().reshape(-1, 1) if tensors["weight_scale"].numel() > 1 \
            else q * tensors["weight_scale"].float()
    scale = tensors["weight_scale_inv"].float()
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:q.shape[0], :q.shape[1]]
    return q * full


def write_fp8_checkpoint(source: str, folder: str, scheme: str) -> None:
    os.makedirs(folder, exist_ok=True)
    tensors = {}
    for name in sorted(f for f in os.listdir(source) if f.endswith(".safetensors")):
        for key, value in load_file(os.path.join(source, name)).items():
            if key.endswith(LINEAR_SUFFIXES):
                prefix = key.removesuffix("weight")
                tensors |= {prefix + k: v for k, v in quantize(value, scheme).items()}
            else:
                tensors[key] = value
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    for name in os.listdir(source):
        if not name.endswith(".safetensors") and os.path.isfile(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
    if scheme == "block":
        config["quantization_config"]["weight_block_size"] = [128, 128]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
