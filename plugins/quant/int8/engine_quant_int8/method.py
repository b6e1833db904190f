"""Online int8: each linear weight is rounded to int8 with one scale per output channel
when loading ends. ``int8-w8a16`` multiplies activations in their own dtype by the int8
weight; ``int8-w8a8`` also rounds every activation row to int8 (its own scale, computed
per step) and multiplies in integers. Kernels: :mod:`engine.layers.int8`.

Mixture-of-experts layers are quantized the same way, each expert's stacked projection rows
with their own scales, and run expert by expert over the rows routed to it (the int8
kernels take one weight).

Tensor parallelism: each rank quantizes its part of the float weight, with the scales the
whole rows get — a column-parallel rank holds whole rows, a row-parallel one maxes each
row's magnitude over the ranks (``Linear.full_row_max``) — so its int8 values are exactly
TP=1's. W8A8 rounds a row-parallel rank's activations with a scale over its own input
columns (no collective per step); W8A16 differs from TP=1 by the all-reduce's rounding only."""

from __future__ import annotations

import torch
from torch import nn

from engine.interfaces import QuantMethod
from engine.layers.batch_invariant import invariant_packing
from engine.layers.int8 import Int8Rows, row_abs_max


class Int8WeightOnly(QuantMethod):
    name = "int8-w8a16"
    quantizes_experts = True
    shards_for_tensor_parallel = True
    experts_whole_because = "each expert's int8 row scales are taken over whole down rows at load"

    @classmethod
    def supports(cls, platform) -> list[str]:
        return (
            []
            if platform.device_type == "cpu"
            else [f"int8 kernels are wired for the CPU, not {platform.device_type}"]
        )

    @classmethod
    def describe(cls, platform) -> str:
        return "torch._weight_int8pack_mm (weight-only int8, per-channel scales)"

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        weight = nn.Parameter(
            torch.empty(sum(output_sizes), input_size, dtype=self.ctx.dtype), requires_grad=False
        )
        weight.output_dim, weight.input_dim = 0, 1
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        ops = self.ctx.platform.layer_ops(self.ctx.dtype)
        weight = layer.weight.data
        abs_max = layer.full_row_max(row_abs_max(weight))
        layer.int8 = Int8Rows.from_float(weight, self.ctx.dtype, ops, abs_max)
        del layer.weight

    def apply(self, layer, x, bias):
        out = self._matmul(layer.int8, x)
        return out if bias is None else out + bias

    def _matmul(self, weight: Int8Rows, x: torch.Tensor) -> torch.Tensor:
        return weight(x)

    def dequantize(self, layer) -> torch.Tensor:
        return layer.int8.dequantize()

    def process_moe_weights_after_loading(self, layer: nn.Module) -> None:
        ops = self.ctx.platform.layer_ops(self.ctx.dtype)
        layer.int8_experts = nn.ModuleList(
            Int8Rows.from_float(w, self.ctx.dtype, ops) for w in layer.weight.data
        )
        del layer.weight

    def apply_moe(self, layer, x, segments) -> torch.Tensor:
        experts = layer.int8_experts
        return segments.per_expert(x, experts[0].q.shape[0], lambda e, rows: self._matmul(experts[e], rows))

    def dequantize_moe(self, layer) -> torch.Tensor:
        return torch.stack([expert.dequantize() for expert in layer.int8_experts])


class Int8Dynamic(Int8WeightOnly):
    """W8A8. Where the platform packs group-affine weights (``LayerOps.pack_affine``: the
    cpu-native platform's VNNI kernel), the int8 rows go there as a Q8_0-shaped weight and the
    activations are rounded per 32 inputs rather than per row: torch's ``_int_mm`` with its
    quantize, rescale and outlier passes ran at 0.93–0.95× bf16 from batch 16 to 256, the packed
    kernel at the default GGUF path's speed, and a group's rounding confines an outlier
    channel's damage to its 32 inputs (no outlier pass needed). Elsewhere: ``_int_mm``."""

    name = "int8-w8a8"

    @classmethod
    def describe(cls, platform) -> str:
        return (
            "the platform's packed group-affine kernel where it has one (int8 activations per 32 "
            "inputs), else torch._int_mm (dynamic per-token activation scales, outlier channels in float)"
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        super().process_weights_after_loading(layer)
        affine = layer.int8.as_affine()
        packed = (
            self.ctx.platform.layer_ops(self.ctx.dtype).pack_affine(affine) if affine is not None else None
        )
        if packed is not None:
            del layer.int8
            layer.packed = invariant_packing(packed, self.ctx.batch_invariant)

    def apply(self, layer, x, bias):
        packed = layer._modules.get("packed")  # not getattr: a miss would raise and catch per call
        if packed is None:
            return super().apply(layer, x, bias)
        out = packed(x)
        return out if bias is None else out + bias

    def kernel_of(self, layer):
        """The packed kernel (unpadded under ``--batch-invariant`` where it declares
        ``invariant_rows``); ``_int_mm`` runs in 16-row tiles, each row's outlier channels its
        own (``_matmul``)."""
        return layer._modules.get("packed")

    def dequantize(self, layer) -> torch.Tensor:
        packed = layer._modules.get("packed")
        return super().dequantize(layer) if packed is None else packed.dequantize().to(self.ctx.dtype)

    def _matmul(self, weight: Int8Rows, x: torch.Tensor) -> torch.Tensor:
        return weight.forward_dynamic(x, own_outliers=self.ctx.batch_invariant)
