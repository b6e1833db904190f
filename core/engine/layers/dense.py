"""A plain weight held in oneDNN's blocked layout for its matmul.

torch's ``F.linear`` in bfloat16 on the CPU reads the weight as it lies, row-major; oneDNN's
prepacked weight (the layout its kernels stream, made once at load) gives the same products
bit for bit and, measured interleaved in one process, 2–3.6× at a few rows and 1.2–1.4× at
64 (576 × 3072). The packed tensor replaces the weight, so nothing is held twice."""

from __future__ import annotations

import functools

import torch

from engine.layers.module import Layer


def packable(weight: torch.Tensor) -> bool:
    """oneDNN packs bfloat16 only where the CPU computes it (AVX-512 or AVX-NE-CONVERT; an
    AVX2-only EPYC does not): elsewhere the weight stays as it is, for torch's own matmul."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and _bf16_supported()
    )


@functools.cache
def _bf16_supported() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedDense(Layer):
    """``self(x, bias)`` = x · wᵀ (+ bias) for x [..., K]; ``dequantize()`` = w [N, K], exact."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def dequantize(self) -> torch.Tensor:
        return self.packed.to_dense()
