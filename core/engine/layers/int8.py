"""Int8 weights with one scale per output row, shared by quant plugins.

``forward`` is weight-only (W8A16): torch's CPU ``_weight_int8pack_mm`` where it runs, a
dequantize-then-matmul elsewhere. ``forward_dynamic`` (W8A8) also rounds each activation row
to int8 with its own scale and multiplies in integers (``torch._int_mm``, VNNI/AMX on x86),
then rescales by the outer product of the two scale vectors; outlier input channels are
kept out of the int8 product and multiplied in float — the channels where any row of the call
exceeds the threshold, or under ``--batch-invariant`` each row's own (``own_outliers``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.group_affine import AffineWeight
from engine.layers.module import Layer
from engine.layers.ops import LayerOps

# W8A8 multiplies input channels where some activation exceeds this in the activation dtype
# (LLM.int8()'s mixed-precision decomposition, its threshold): ~1.4 % of the default model's
# channels per step, which took teacher-forced agreement with bf16 from 88 % to 93 %.
OUTLIER_THRESHOLD = 6.0

# W8A8 works on at most this many activation rows at a time, so its float temporaries stay
# in cache: on 2 cores a 2048-token prefill chunk ran 1.9× slower unchunked than bf16,
# 0.75× chunked by 512.
ROWS_PER_CHUNK = 512


def row_abs_max(weight: torch.Tensor) -> torch.Tensor:
    """Each row's largest magnitude, float32 [N]: what :func:`quantize_rows` scales by."""
    return weight.float().abs().amax(dim=-1)


def quantize_rows(
    weight: torch.Tensor, abs_max: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric int8 per row: -> (q int8 [N, K], scale float32 [N]).
    ``abs_max``: each row's largest magnitude when ``weight`` holds only part of the rows'
    columns (a tensor-parallel rank's): the part then rounds as the whole rows would."""
    w = weight.float()
    scale = (row_abs_max(w) if abs_max is None else abs_max).clamp(min=1e-12) / 127
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


class Int8Rows(Layer):
    """int8 weight rows; ``ops`` (the platform's :class:`LayerOps`) quantizes activations and
    rescales int32 results for W8A8 — the passes around the int8 matmul, which cost as much
    as it saves when each is a torch call."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, ops: LayerOps | None = None):
        super().__init__()
        self.ops = ops or LayerOps()
        self.register_buffer("q", q.contiguous())
        self.register_buffer("scale", scale.to(dtype))
        self.register_buffer("scale_f32", scale.float()[None, :])
        self.fast = q.device.type == "cpu" and hasattr(torch, "_weight_int8pack_mm")
        self.q_t = self.q.t()  # [K, N] view: _int_mm's layout for the second operand
        self._last_columns: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        dtype: torch.dtype,
        ops: LayerOps | None = None,
        abs_max: torch.Tensor | None = None,
    ) -> Int8Rows:
        return cls(*quantize_rows(weight, abs_max), dtype, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast:
            return torch._weight_int8pack_mm(x.contiguous(), self.q, self.scale)
        return F.linear(x, self.dequantize().to(x.dtype))

    def forward_dynamic(self, x: torch.Tensor, own_outliers: bool = False) -> torch.Tensor:
        """W8A8 of x [M, K]; ``own_outliers``: each row's outlier channels are its own, so its
        result does not depend on the rows beside it (``--batch-invariant``)."""
        dynamic = self._own_outliers if own_outliers else self._dynamic
        if x.shape[0] <= ROWS_PER_CHUNK:
            return dynamic(x)
        out = torch.empty(x.shape[0], self.q.shape[0], dtype=x.dtype, device=x.device)
        for start in range(0, x.shape[0], ROWS_PER_CHUNK):
            out[start : start + ROWS_PER_CHUNK] = dynamic(x[start : start + ROWS_PER_CHUNK])
        return out

    def _dynamic(self, x: torch.Tensor) -> torch.Tensor:
        xq, x_scale, outliers = self.ops.quantize_rows_int8(x, OUTLIER_THRESHOLD)
        acc = torch._int_mm(xq, self.q_t) if self.fast else xq.float() @ self.q_t.float()
        if not outliers.numel():
            return self.ops.rescale_int32(acc, x_scale, self.scale_f32, x.dtype)
        out = self.ops.rescale_int32(acc, x_scale, self.scale_f32, torch.float32)
        return out.addmm_(x.index_select(1, outliers).float(), self._columns(outliers).t()).to(x.dtype)

    def _own_outliers(self, x: torch.Tensor) -> torch.Tensor:
        """``_dynamic`` with a row's outlier channels those where that row exceeds the
        threshold: they leave its int8 product and its scale, and come back in float one
        channel at a time (ascending, a multiply-add per element: no reduction whose order the
        batch could move), an exact zero for every row the channel is not an outlier of."""
        outlier = x.abs() > OUTLIER_THRESHOLD
        xq, x_scale, _ = self.ops.quantize_rows_int8(x.masked_fill(outlier, 0), float("inf"))
        acc = torch._int_mm(xq, self.q_t) if self.fast else xq.float() @ self.q_t.float()
        out = self.ops.rescale_int32(acc, x_scale, self.scale_f32, torch.float32)
        channels = outlier.any(dim=0).nonzero().flatten()
        if channels.numel():
            values = x.float().masked_fill_(~outlier, 0).index_select(1, channels)
            for column, value in zip(self._columns(channels).t(), values.t()):
                out.addcmul_(value[:, None], column[None, :])
        return out.to(x.dtype)

    def _columns(self, channels: torch.Tensor) -> torch.Tensor:
        """The dequantized weight columns [N, n] of these input channels. The last set is
        kept: a layer's outlier channels recur step after step, and gathering columns of the
        row-major int8 weight touches a cache line per row."""
        if self._last_columns is None or not torch.equal(self._last_columns[0], channels):
            self._last_columns = (channels, self.q.index_select(1, channels).float().mul_(self.scale_f32.t()))
        return self._last_columns[1]

    def dequantize(self) -> torch.Tensor:
        return self.q.to(self.scale.dtype) * self.scale[:, None]

    def as_affine(self, group: int = 32) -> AffineWeight | None:
        """The same weight as a group-affine one (``q + 128`` unsigned, offset ``−128 · scale``,
        the row's scale in every group: what GGUF's Q8_0 is), for a platform's packed kernel
        (:meth:`LayerOps.pack_affine`); None when the rows do not split into ``group`` inputs."""
        rows, cols = self.q.shape
        if cols % group:
            return None
        scale = self.scale_f32.t().expand(rows, cols // group).contiguous()
        return AffineWeight((self.q.to(torch.int16) + 128).to(torch.uint8), scale, scale * -128, group, 8)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.q[ids].to(self.scale.dtype) * self.scale[ids, None]
