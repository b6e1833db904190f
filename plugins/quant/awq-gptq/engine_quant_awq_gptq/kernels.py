"""Which kernel runs a group-affine weight, fastest first:

1. ``packed``: the platform's packed kernel (``LayerOps.pack_affine``; cpu-native: int8
   activations × 4/8-bit weights on VNNI, the path GGUF's Q4_1 takes). It holds groups of 32
   inputs: a group of 64 or 128 is handed over as 2 or 4 groups of 32 with the same scale and
   offset (the same weight). Its scales and offsets are stored in float16 when float16 holds
   them all exactly, else in float32 (twice the bytes per group, a fifth more per weight for
   4 bits); AWQ's and GPTQ's scales are float16 but their offsets ``−z·s`` rarely are, so the
   offsets are rounded to float16 for this kernel: an error of at most ``z·s·2⁻¹¹`` (< 1/128
   of a quantization step for 4 bits), below the kernel's own rounding of activations to int8.
2. ``int4pack``: torch's CPU int4 matmul in 4-bit planes (groups of 32…256), exact up to
   rounding the scales to the activation dtype.
3. ``dense``: dequantized once at load to the activation dtype (any other device or group).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers import Layer
from engine.layers.batch_invariant import invariant_packing
from engine.layers.group_affine import INT4PACK_GROUPS, AffineWeight, Int4Planes, int4pack_unavailable

KERNEL_GROUP = 32  # the packed kernel's group; other multiples of it are split into it


def split_groups(weight: AffineWeight, group: int) -> AffineWeight:
    """The same weight with groups of ``group`` inputs (a divisor of its group)."""
    if weight.group == group:
        return weight
    repeat = weight.group // group
    return AffineWeight(
        weight.q,
        weight.scale.repeat_interleave(repeat, dim=1),
        weight.offset.repeat_interleave(repeat, dim=1),
        group,
        weight.bits,
    )


def float16_offsets(weight: AffineWeight) -> AffineWeight:
    """``weight`` with its offsets rounded to float16 where its scales are float16 already."""
    if not torch.equal(weight.scale.half().float(), weight.scale):
        return weight
    return AffineWeight(weight.q, weight.scale, weight.offset.half().float(), weight.group, weight.bits)


def packed_kernel(
    weight: AffineWeight, platform, dtype: torch.dtype, batch_invariant: bool = False
) -> Layer | None:
    """The platform's packed kernel (as ``--batch-invariant`` wants it where ``batch_invariant``)."""
    ops = platform.layer_ops(dtype)
    packed = ops.pack_affine(float16_offsets(weight))
    if packed is None and weight.group % KERNEL_GROUP == 0 and weight.group != KERNEL_GROUP:
        packed = ops.pack_affine(float16_offsets(split_groups(weight, KERNEL_GROUP)))
    return invariant_packing(packed, batch_invariant)


def int4pack_kernel(weight: AffineWeight, device, dtype: torch.dtype) -> Layer | None:
    if weight.group not in INT4PACK_GROUPS and weight.group % KERNEL_GROUP == 0:
        weight = split_groups(weight, KERNEL_GROUP)
    return None if int4pack_unavailable(weight, device) else Int4Planes(weight, dtype)


def group_affine_kernel(
    weight: AffineWeight, platform, dtype: torch.dtype, batch_invariant: bool = False
) -> tuple[Layer, str]:
    """-> (the module computing x · wᵀ, the path's name)."""
    packed = packed_kernel(weight, platform, dtype, batch_invariant)
    if packed is not None:
        return packed, "packed"
    planes = int4pack_kernel(weight, platform.device, dtype)
    if planes is not None:
        return planes, "int4pack"
    return dense_kernel(weight.dequantize(dtype), platform, dtype), "dense"


def dense_kernel(weight: torch.Tensor, platform, dtype: torch.dtype) -> Layer:
    """A float weight [N, K]: prepacked for the platform's matmul where it has a layout."""
    return platform.layer_ops(dtype).pack_dense(weight.to(dtype)) or DenseWeight(weight.to(dtype))


class DenseWeight(Layer):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight.contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def dequantize(self) -> torch.Tensor:
        return self.weight


def probe_path(platform) -> str:
    """The path a 4-bit weight with 32-input groups takes on ``platform`` (``engine plugins``)."""
    q = torch.zeros(64, 64, dtype=torch.uint8)
    scale = torch.ones(64, 2)
    weight = AffineWeight(q, scale, torch.zeros_like(scale), 32, 4)
    if packed_kernel(weight, platform, torch.bfloat16) is not None:
        return "packed"
    return "int4pack" if not int4pack_unavailable(weight, platform.device) else "dense"
