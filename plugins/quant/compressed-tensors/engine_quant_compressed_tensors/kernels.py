"""The kernels a compressed-tensors layer runs that the sibling plugins do not already hold as
one module: W8A8 over the core's int8 rows (dynamic per-token or static per-tensor activation
scales), NVFP4 activations rounded before the weight's kernel, and an FP8 layer served by the
fp8 plugin's own method.

Group-affine weights (``pack-quantized``, weight-only ``int-quantized``) go to
``engine_quant_awq_gptq.kernels.group_affine_kernel``, the path AWQ and GPTQ take; NVFP4 weights
to the platform's FP4 kernel (:func:`fp4_kernel`)."""

from __future__ import annotations

import torch
from torch import nn

from engine.interfaces import QuantContext
from engine.layers import Layer
from engine.layers.fp4 import E2M1, Fp4Weight
from engine.layers.group_affine import AffineWeight
from engine.layers.int8 import Int8Rows
from engine_quant_awq_gptq.kernels import dense_kernel
from engine_quant_compressed_tensors.config import NVFP4_GROUP
from engine_quant_fp8.method import FP8, FP8_MAX, Fp8LinearMethod


def int8_rows(weight: AffineWeight, dtype: torch.dtype, ops) -> Int8Rows:
    """An 8-bit affine weight with one scale per row (``int8_values`` of a channel or tensor
    scheme) back as int8 rows and their scales."""
    q = (weight.q.to(torch.int16) - 128).to(torch.int8)
    return Int8Rows(q, weight.scale[:, 0].contiguous(), dtype, ops)


class DynamicInt8(Layer):
    """W8A8 with each activation row rounded to int8 by its own scale (``Int8Rows.forward_dynamic``;
    ``own_outliers`` under ``--batch-invariant``)."""

    def __init__(self, rows: Int8Rows, own_outliers: bool = False):
        super().__init__()
        self.int8, self.own_outliers = rows, own_outliers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.int8.forward_dynamic(x, self.own_outliers)

    def dequantize(self) -> torch.Tensor:
        return self.int8.dequantize()


class StaticInt8(Layer):
    """W8A8 with the checkpoint's per-tensor activation scale: ``x`` rounded to
    ``round(x / input_scale)`` in int8, an integer matmul, then ``input_scale · weight_scale``."""

    def __init__(self, rows: Int8Rows, input_scale: float):
        super().__init__()
        self.int8, self.input_scale = rows, input_scale
        self.register_buffer("out_scale", rows.scale_f32 * input_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq = (x.float() / self.input_scale).round_().clamp_(-128, 127).to(torch.int8)
        q_t = self.int8.q_t
        acc = torch._int_mm(xq, q_t) if self.int8.fast else xq.float() @ q_t.float()
        return (acc.float() * self.out_scale).to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.int8.dequantize()


class Concat(Layer):
    """Several kernels side by side over the same inputs (shards that cannot share one)."""

    def __init__(self, parts: list[Layer]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([part.dequantize() for part in self.parts])


def fp4_kernel(weight: Fp4Weight, platform, dtype: torch.dtype) -> tuple[Layer, str]:
    """-> (the module computing x · wᵀ, the path's name): the platform's FP4 kernel
    (``LayerOps.pack_fp4``), else the weight dequantized at load."""
    packed = platform.layer_ops(dtype).pack_fp4(weight)
    if packed is not None:
        return packed, "fp4"
    return dense_kernel(weight.dequantize(dtype), platform, dtype), "dense"


def fp4_probe(platform) -> str:
    """The path an NVFP4 weight takes on ``platform`` (``engine plugins``)."""
    weight = Fp4Weight(torch.zeros(16, 16, dtype=torch.uint8), torch.ones(16, 2), NVFP4_GROUP)
    return "fp4" if platform.layer_ops(torch.bfloat16).pack_fp4(weight) is not None else "dense"


def per_input_scale(parts: list[tuple], build) -> Layer:
    """``build(weight, scale)`` for shards (:class:`AffineWeight` or :class:`Fp4Weight`) that
    round their inputs on one scale, as one matmul; shards whose scales differ (each
    projection's own observer) each on its own, as the reference rounds them."""
    scales = {scale for _, scale in parts}
    if len(scales) == 1:
        return build(type(parts[0][0]).cat([w for w, _ in parts]), scales.pop())
    return Concat([build(w, scale) for w, scale in parts])


def static_int8(parts: list[tuple[AffineWeight, float]], dtype: torch.dtype, ops) -> Layer:
    return per_input_scale(parts, lambda w, scale: StaticInt8(int8_rows(w, dtype, ops), scale))


# compressed-tensors' cast_to_fp4: the nearest e2m1 magnitude, a tie to the even code (the
# bound's side: True rounds it up)
E2M1_BOUNDS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    magnitude = x.abs()
    code = sum(((magnitude >= b) if up else (magnitude > b)).long() for b, up in E2M1_BOUNDS)
    return E2M1[:8][code] * x.sign()


class Nvfp4Inputs(Layer):
    """NVFP4 activations (W4A4) as compressed-tensors rounds them: per 16 inputs a float8 scale
    ``max|x| / 6 · g`` (0 -> 0.125) over the checkpoint's ``input_global_scale`` g, then
    ``e2m1(x / (scale / g)) · scale / g`` — before the weight's own kernel."""

    def __init__(self, kernel: Layer, global_scale: float):
        super().__init__()
        self.kernel, self.global_scale = kernel, global_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = x.float().unflatten(-1, (-1, NVFP4_GROUP))
        scale = (blocks.abs().amax(-1, keepdim=True) / 6 * self.global_scale).clamp(max=FP8_MAX)
        scale = scale.to(FP8).float()
        scale = torch.where(scale == 0, 0.125, scale) / self.global_scale
        rounded = round_to_e2m1((blocks / scale).clamp(-6, 6)) * scale
        return self.kernel(rounded.flatten(-2).to(x.dtype))

    def dequantize(self) -> torch.Tensor:
        return self.kernel.dequantize()


def nvfp4_activations(parts: list[tuple[Fp4Weight, float]], platform, dtype: torch.dtype) -> Layer:
    """NVFP4 weights (:func:`fp4_kernel`) behind NVFP4-rounded inputs."""
    return per_input_scale(parts, lambda w, scale: Nvfp4Inputs(fp4_kernel(w, platform, dtype)[0], scale))


class Fp8Layer(Layer):
    """An FP8 layer held and run by the fp8 plugin's method (its load-time dequantization on
    the CPU, ``torch._scaled_mm`` on CUDA ≥ 8.9): the compressed-tensors tensors are handed to
    it under the names its own format uses."""

    def __init__(self, ctx: QuantContext, block: tuple[int, int] | None, parts: list[dict], output_sizes):
        super().__init__()
        config = {"quant_method": "fp8", "fmt": "e4m3"} | (
            {"weight_block_size": list(block)} if block else {}
        )
        self.method = Fp8LinearMethod(QuantContext(config, ctx.dtype, ctx.platform, ctx.batch_invariant))
        self.inner = nn.Module()
        self.method.create_weights(self.inner, 0, list(output_sizes))
        scale_name = self.method.scale_name
        for shard, part in enumerate(parts):
            self.inner.weight.weight_loader(self.inner.weight, part["weight"], shard)
            scale = getattr(self.inner, scale_name)
            scale.weight_loader(scale, part["weight_scale"], shard)
        self.method.process_weights_after_loading(self.inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self.inner, x, None)

    def dequantize(self) -> torch.Tensor:
        return self.method.dequantize(self.inner)
