"""The Hugging Face ``fp8`` checkpoint layout, written from float weights (tests,
benchmarks): e4m3 weights with per-tensor, per-channel or 128×128 block scales."""

from __future__ import annotations

import torch

from engine_quant_fp8.method import FP8, FP8_MAX


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
        return q * tensors["weight_scale"].float().reshape(-1, 1).expand(q.shape[0], 1)
    scale = tensors["weight_scale_inv"].float()
    return q * scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[: q.shape[0], : q.shape[1]]


def quantization_config(scheme: str) -> dict:
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
    return config | ({"weight_block_size": [128, 128]} if scheme == "block" else {})
