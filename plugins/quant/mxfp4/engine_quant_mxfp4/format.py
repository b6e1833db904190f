"""The MXFP4 format (OCP Microscaling v1.0) as checkpoints store it: ``weight_blocks`` uint8
[N, K/32, 16] (two e2m1 codes per byte, the even element in the low nibble, as gpt-oss
ships) and ``weight_scales`` uint8 [N, K/32] (E8M0: 2^(e − 127)).

Doubled, the e2m1 values {0, .5, 1, 1.5, 2, 3, 4, 6} are integers, so a block is exactly
the affine ``(2v + 12) · 2^(e − 128) − 12 · 2^(e − 128)`` with a 5-bit unsigned integer: the
core's int4-plane kernel runs it, and power-of-two scales are exact in any float dtype.
"""

from __future__ import annotations

import torch

from engine.layers.fp4 import E2M1, unpack_codes
from engine.layers.group_affine import AffineWeight

BLOCK = 32


def _codes(blocks: torch.Tensor) -> torch.Tensor:
    """[N, K/32, 16] bytes -> [N, K] e2m1 codes."""
    return unpack_codes(blocks.reshape(blocks.shape[0], -1))


def to_affine(blocks: torch.Tensor, scales: torch.Tensor) -> AffineWeight:
    q = ((E2M1 * 2).to(torch.int16)[_codes(blocks)] + 12).to(torch.uint8)
    scale = torch.exp2(scales.float() - 128)
    return AffineWeight(q, scale, -12 * scale, BLOCK, 5)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Plain math, straight from the specification: value × 2^(e − 127)."""
    values = E2M1[_codes(blocks)].view(blocks.shape[0], -1, BLOCK)
    return (values * torch.exp2(scales.float() - 127)[..., None]).view(blocks.shape[0], -1)


def quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Float [N, K] -> a checkpoint's ``weight_blocks`` and ``weight_scales``: shared exponent
    floor(log2(amax)) − 2, nearest code (tests, benchmarks)."""
    rows, cols = weight.shape
    w = weight.float().view(rows, cols // BLOCK, BLOCK)
    amax = w.abs().amax(-1).clamp(min=2.0**-126)
    exponent = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
    scaled = w / torch.exp2(exponent)[..., None]
    magnitude = (scaled.abs()[..., None] - E2M1[:8]).abs().argmin(-1)
    codes = (magnitude | ((scaled < 0).long() << 3)).to(torch.uint8).view(rows, cols // BLOCK, 16, 2)
    blocks = codes[..., 0] | (codes[..., 1] << 4)
    return {"weight_blocks": blocks, "weight_scales": (exponent + 127).to(torch.uint8)}
