"""MXFP4 checkpoints (``quantization_config.quant_method == "mxfp4"``): linear weights come
as ``weight_blocks`` / ``weight_scales`` and stay 4-bit. Paths: on the CPU the core's
int4-plane kernel (exact); on CUDA the Triton kernel that decodes inside the matmul;
elsewhere dequantize per step (the reference path).

Mixture-of-experts layers: each expert's projection arrives as the same two tensors and gets
the path a linear layer of its blocks would (one child module per expert, run over the rows
routed to it)."""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from engine.interfaces import QuantMethod
from engine.layers.group_affine import Int4Planes, int4pack_unavailable
from engine_quant_mxfp4.format import BLOCK, dequantize, to_affine

PATHS = {
    "int4pack": (
        "the platform's packed kernel or int4pack planes (doubled e2m1 values, exact power-of-two scales)"
    ),
    "triton": "Triton kernel decoding e2m1 and E8M0 inside the matmul",
    "dequantize": "dequantize per step",
}


def kernel_path(platform) -> str:
    if platform.device_type == "cpu" and hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        return "int4pack"
    if platform.device_type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "dequantize"


class Mxfp4LinearMethod(QuantMethod):
    name = "mxfp4"
    quantizes_experts = True

    def __init__(self, ctx):
        super().__init__(ctx)
        if ctx.quant_config is None:
            raise ValueError("quantization: mxfp4 reads MXFP4 checkpoints; it does not quantize online")
        self.path = kernel_path(ctx.platform)

    @classmethod
    def describe(cls, platform) -> str:
        return PATHS[kernel_path(platform)]

    def create_weights(self, layer, input_size, output_sizes):
        self._register(layer, (), input_size, output_sizes)

    def create_moe_weights(self, layer, num_experts, input_size, output_sizes):
        self._register(layer, (num_experts,), input_size, output_sizes)

    def _register(self, layer, experts: tuple[int, ...], input_size: int, output_sizes: list[int]) -> None:
        """``weight_blocks`` [*experts, N, K/32, 16] and ``weight_scales`` [*experts, N, K/32]."""
        if input_size % BLOCK:
            raise ValueError(
                f"quantization: mxfp4 needs input sizes in multiples of {BLOCK}, got {input_size}"
            )
        rows = sum(output_sizes)
        for name, shape in (
            ("weight_blocks", (rows, input_size // BLOCK, BLOCK // 2)),
            ("weight_scales", (rows, input_size // BLOCK)),
        ):
            param = nn.Parameter(torch.empty(*experts, *shape, dtype=torch.uint8), requires_grad=False)
            param.output_dim = 0
            layer.register_parameter(name, param)

    def process_moe_weights_after_loading(self, layer):
        """One child per expert holding its two tensors, then the linear path for each."""
        layer.experts = nn.ModuleList()
        for blocks, scales in zip(layer.weight_blocks.data, layer.weight_scales.data):
            expert = nn.Module()
            expert.register_parameter("weight_blocks", nn.Parameter(blocks, requires_grad=False))
            expert.register_parameter("weight_scales", nn.Parameter(scales, requires_grad=False))
            self.process_weights_after_loading(expert)
            layer.experts.append(expert)
        del layer.weight_blocks, layer.weight_scales

    def apply_moe(self, layer, x, segments):
        experts = layer.experts
        return segments.per_expert(
            x, sum(layer.output_sizes), lambda e, rows: self.apply(experts[e], rows, None)
        )

    def dequantize_moe(self, layer):
        return torch.stack([self.dequantize(expert) for expert in layer.experts])

    def process_weights_after_loading(self, layer):
        if self.path == "int4pack":
            weight = to_affine(layer.weight_blocks.data, layer.weight_scales.data)
            packed = self.ctx.platform.layer_ops(self.ctx.dtype).pack_affine(weight)  # the platform's kernel
            if packed is not None or not int4pack_unavailable(weight, self.ctx.platform.device):
                layer.planes = packed if packed is not None else Int4Planes(weight, self.ctx.dtype)
                del layer.weight_blocks, layer.weight_scales

    def apply(self, layer, x, bias):
        if hasattr(layer, "planes"):
            out = layer.planes(x)
        elif self.path == "triton":
            from engine_quant_mxfp4.triton_kernel import mxfp4_matmul

            out = mxfp4_matmul(x, layer.weight_blocks, layer.weight_scales)
        else:
            out = F.linear(x, self.dequantize(layer).to(x.dtype))
        return out if bias is None else out + bias

    def dequantize(self, layer):
        if hasattr(layer, "planes"):
            return layer.planes.dequantize()
        return dequantize(layer.weight_blocks, layer.weight_scales).to(self.ctx.dtype)
