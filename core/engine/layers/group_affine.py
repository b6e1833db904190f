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

import functools
import math

import attrs
import torch
import torch.nn.functional as F

from engine.layers.module import Layer

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
        """Stack along the output rows (fused projections); groups and bit widths must agree."""
        first = parts[0]
        if any((p.group, p.bits) != (first.group, first.bits) for p in parts):
            raise ValueError("cannot fuse affine weights of different group sizes or bit widths")
        return AffineWeight(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.offset for p in parts]),
            first.group,
            first.bits,
        )


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


class Int4Planes(Layer):
    """An :class:`AffineWeight` packed for the CPU int4 matmul, one 4-bit plane per 4 bits.

    The planes sit side by side along the inputs — [plane 0 | plane 1], each with its own
    group scales — so a two-plane weight is one kernel call over the inputs repeated twice:
    the same bytes as two calls, 12 % less time for the 49152-row LM head, and one bf16
    rounding of the sum instead of two."""

    def __init__(self, weight: AffineWeight, dtype: torch.dtype):
        super().__init__()
        self.group, (self.out_features, self.in_features) = weight.group, weight.shape
        weight = _pad_rows(weight, -self.out_features % _PAD)  # whole tiles of every known layout
        self.num_planes = math.ceil(weight.bits / 4)
        nibbles, scales = [], []
        zero = weight.offset + 8 * weight.scale  # plane 0's zero; higher planes' constants fold in
        for plane in range(self.num_planes):
            q4 = ((weight.q >> (4 * plane)) & 15).to(torch.int32)
            scale = weight.scale * 16**plane
            if plane > 0:
                shift = 8 if weight.bits - 4 * plane <= 3 else 0  # values in 0..7 stored as 8..15
                q4 += shift
                zero = zero + (8 - shift) * scale
            nibbles.append(q4)
            scales.append(scale)
        zeros = [zero] + [torch.zeros_like(s) for s in scales[1:]]
        packed = torch._convert_weight_to_int4pack_for_cpu(torch.cat(nibbles, dim=1), 2)
        scales_zeros = torch.cat([torch.stack([s, z], dim=-1).transpose(0, 1) for s, z in zip(scales, zeros)])
        self.register_buffer("packed", packed)  # [N, planes·K/2]
        self.register_buffer("scales_zeros", scales_zeros.to(dtype).contiguous())  # [planes·K/group, N, 2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # a check, not a reshape: every op counts at batch 1
            x = x.reshape(-1, self.in_features)
        if x.shape[0] >= DENSE_ROWS and packed_rows_readable():
            return F.linear(x, self.dense())
        x = x.repeat(1, self.num_planes) if self.num_planes > 1 else x.contiguous()
        out = torch._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_zeros)
        return out if self.packed.shape[0] == self.out_features else out[:, : self.out_features]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight (embedding lookups), unpacked from the planes; needs
        :func:`packed_rows_readable`."""
        q4 = _unpack_rows(self.packed, ids, self.num_planes * self.in_features).float() - 8
        sz = self.scales_zeros[:, ids].float()  # [planes·G, M, 2]
        w = q4.view(ids.shape[0], -1, self.group) * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]
        return w.view(ids.shape[0], self.num_planes, self.in_features).sum(1).to(self.scales_zeros.dtype)

    def dense(self) -> torch.Tensor:
        """The weight, [N, K] in the activation dtype, unpacked from the planes whole (a few
        vectorized passes; needs :func:`packed_rows_readable`). The int4 kernel's time grows
        with the rows like a matrix-vector product per row (42 µs a row for 3072×576 on one
        core, bf16's matmul 18 µs): from :data:`DENSE_ROWS` rows, unpacking (9 ms) and
        multiplying in bf16 is faster — a 2048-token prefill chunk's matmuls 2.3× (4-bit) to
        5× (two planes)."""
        rows, width, tile = self.packed.shape[0], self.num_planes * self.in_features, int4_tile()
        tiles = self.packed.view(rows // tile, width, tile // 2)
        q4 = torch.stack([tiles & 15, tiles >> 4], dim=1).transpose(2, 3)  # [tiles, 2, tile/2, width]
        q4 = q4.reshape(rows, width // self.group, self.group).to(self.scales_zeros.dtype) - 8
        scales, zeros = (t.t()[..., None] for t in self.scales_zeros.unbind(-1))  # [rows, planes·G, 1]
        w = torch.addcmul(zeros, q4, scales).reshape(rows, self.num_planes, self.in_features)
        w = w.sum(1) if self.num_planes > 1 else w[:, 0]
        return w[: self.out_features]

    def dequantize(self) -> torch.Tensor:
        """The weight these planes hold, [N, K], read back through the kernel itself."""
        return self(torch.eye(self.in_features, dtype=self.scales_zeros.dtype)).t().contiguous()


def _pad_rows(weight: AffineWeight, pad: int) -> AffineWeight:
    if not pad:
        return weight
    q, scale, offset = (F.pad(t, (0, 0, 0, pad)) for t in (weight.q, weight.scale, weight.offset))
    return AffineWeight(q, scale, offset, weight.group, weight.bits)


DENSE_ROWS = 512  # rows of input from which Int4Planes unpacks its weight and multiplies densely

# torch's CPU int4 packing (checked at run time, never assumed): the [N, K/2] bytes are tiles
# of T output rows, each [K, T/2]: row n's value k sits at tile n // T, line k, column n % (T/2),
# in the low nibble for n % T < T/2, else the high one. T follows the CPU's vector width: 64
# with AVX-512, 32 with AVX2 (observed on EPYC).
_TILES = (64, 32, 16)
_PAD = 64  # rows are padded to whole tiles of any of them


def _unpack_rows(packed: torch.Tensor, ids: torch.Tensor, in_features: int, tile: int | None = None):
    tile = tile or int4_tile()
    tiles = packed.view(-1, in_features, tile // 2)
    picked = tiles[ids // tile, :, ids % (tile // 2)]  # [M, K]
    high = ((ids % tile) >= tile // 2)[:, None]
    return torch.where(high, picked >> 4, picked & 15)


@functools.cache
def int4_tile() -> int | None:
    """The tile height T of this torch/CPU's int4 packing, or None when it packs otherwise."""
    if not hasattr(torch, "_convert_weight_to_int4pack_for_cpu"):
        return None
    q = torch.randint(0, 16, (2 * _PAD, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 2)
    if packed.numel() * 2 != q.numel():
        return None
    ids = torch.arange(q.shape[0])
    return next((t for t in _TILES if (_unpack_rows(packed, ids, 64, t).to(torch.int32) == q).all()), None)


def packed_rows_readable() -> bool:
    """Whether rows and the dense weight can be read back from this CPU's int4 packing."""
    return int4_tile() is not None
