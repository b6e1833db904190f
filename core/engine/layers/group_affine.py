"""Group-wise affine integer weights and their CPU kernel, shared by quant plugins.

Most block formats (GGUF's Q4_0…Q8_0 and K-quants, MXFP4 once its FP4 values are doubled)
are exactly ``w = q · scale + offset`` with an unsigned integer ``q`` and one scale/offset
per group of consecutive inputs. :class:`AffineWeight` holds that form; it is the plain-math
reference (``dequantize``) and supports row gathers for embedding tables.

:class:`Int4Planes` runs it on torch's CPU int4 matmul (``_weight_int4pack_mm_for_cpu``,
which computes ``x · ((q4 − 8) · s + z)ᵀ`` per group): a ``b``-bit ``q`` is split into
⌈b/4⌉ 4-bit planes, plane ``p`` with scale ``s·16ᵖ``. Higher planes carry no zero (their
values are stored shifted by 8 when they fit in 0..7, so they add nothing to undo); every
constant is folded into plane 0's zero, which keeps it small (Q8_0: 8·d, not 136·d) and its
rounding harmless. The result is exact up to rounding the scales to the activation dtype.
"""

from __future__ import annotations

import math

import attrs
import torch
from torch import nn

INT4PACK_GROUPS = (32, 64, 128, 256)


@attrs.frozen
class AffineWeight:
    q: torch.Tensor  # uint8 [N, K], every value < 2**bits
    scale: torch.Tensor  # float32 [N, K // group]
    offset: torch.Tensor  # float32 [N, K // group]
    group: int
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return _affine(self.q, self.scale, self.offset, self.group).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return _affine(self.q[ids], self.scale[ids], self.offset[ids], self.group).to(dtype)

    @staticmethod
    def cat(parts: list[AffineWeight]) -> AffineWeight:
        """Stack along the output rows (fused projections); groups and bits must agree."""
        first = parts[0]
        if any((p.group, p.bits) != (first.group, first.bits) for p in parts):
            raise ValueError("cannot fuse affine weights of different group sizes or bit widths")
        return AffineWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                            torch.cat([p.offset for p in parts]), first.group, max(p.bits for p in parts))


def _affine(q, scale, offset, group):
    rows, cols = q.shape
    w = q.view(rows, cols // group, group).float() * scale[..., None] + offset[..., None]
    return w.view(rows, cols)


def int4pack_unavailable(weight: AffineWeight, device: torch.device | str) -> list[str]:
    """Reasons :class:`Int4Planes` cannot run ``weight`` on ``device``; empty when it can."""
    reasons = []
    if torch.device(device).type != "cpu":
        reasons.append("int4pack planes are a CPU kernel")
    if not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        reasons.append("this torch has no _weight_int4pack_mm_for_cpu")
    if weight.group not in INT4PACK_GROUPS:
        reasons.append(f"group size {weight.group} is not one of {INT4PACK_GROUPS}")
    if weight.bits > 8:
        reasons.append(f"{weight.bits}-bit values need more than two planes")
    return reasons


class Int4Planes(nn.Module):
    """An :class:`AffineWeight` packed for the CPU int4 matmul, one packed plane per 4 bits."""

    def __init__(self, weight: AffineWeight, dtype: torch.dtype):
        super().__init__()
        self.group, self.in_features = weight.group, weight.shape[1]
        self.num_planes = math.ceil(weight.bits / 4)
        zero0 = weight.offset + 8 * weight.scale
        for plane in range(self.num_planes):
            q4 = ((weight.q >> (4 * plane)) & 15).to(torch.int32)
            scale = weight.scale * 16 ** plane
            if plane > 0:
                shift = 8 if weight.bits - 4 * plane <= 3 else 0  # hi values in 0..7 stored as 8..15
                q4 += shift
                zero0 = zero0 + (8 - shift) * scale
            self.register_buffer(f"packed{plane}", torch._convert_weight_to_int4pack_for_cpu(q4, 2))
            self.register_buffer(f"scales{plane}", scale)
        for plane in range(self.num_planes):
            scale = getattr(self, f"scales{plane}")
            zero = zero0 if plane == 0 else torch.zeros_like(scale)
            self.register_buffer(f"scales_zeros{plane}",
                                 torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype))
            delattr(self, f"scales{plane}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1, self.in_features).contiguous()
        out = None
        for plane in range(self.num_planes):
            part = torch._weight_int4pack_mm_for_cpu(x, getattr(self, f"packed{plane}"), self.group,
                                                     getattr(self, f"scales_zeros{plane}"))
            out = part if out is None else out.add_(part)
        return out

    def dequantize(self) -> torch.Tensor:
        """The weight these planes hold, [N, K], read back through the kernel itself."""
        dtype = self.scales_zeros0.dtype
        return self(torch.eye(self.in_features, dtype=dtype)).t().contiguous()
