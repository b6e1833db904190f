"""FP4 weights with a float scale per block (NVFP4, MXFP4) on the kernel of ``fp4_gemm.c``:
e2m1 codes decoded inside the matmul, float activations as they are.

:class:`PackedFp4` is what :meth:`NativeLayerOps.pack_fp4` returns. Its bytes are the
checkpoint's (codes two a byte, row by row) and one float32 scale a block: 0.75 B a weight for
NVFP4's blocks of 16, against bfloat16's 2. Every batch size runs the kernel: on an AVX2 EPYC
it beat dequantize + torch's bfloat16 GEMM from 1 to 256 rows (the cpu-native README has the
figures). A CPU whose bfloat16 GEMM runs on AMX tiles may do better dequantizing long prefill
chunks, as the group-affine kernel does; that has not been measured for this one.
"""

from __future__ import annotations

import functools

import torch

from engine.layers import Layer
from engine.layers.fp4 import Fp4Weight
from engine.native import load_source
from engine.native.tape import NativeKernel, bind
from engine_platforms_cpu_native import kernels
from engine_platforms_cpu_native.kernels import activation_rows

SOURCE = kernels.SOURCE.with_name("fp4_gemm.c")
SUB_BLOCK = 16  # the kernel decodes 16 codes at a time: a block is a multiple of it
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


@functools.cache
def kernels(portable: bool = False) -> dict[str, NativeKernel]:
    """Every function of ``fp4_gemm.h``, from this CPU's build or the ``portable`` one (plain C)."""
    library = load_source(SOURCE, portable=portable)
    return {symbol: bind(library, symbol) for symbol in library.prototypes}


def unpackable(weight: Fp4Weight, dtype: torch.dtype) -> list[str]:
    """Reasons the kernel cannot hold ``weight`` for activations of ``dtype``; empty when it can."""
    reasons = []
    if dtype not in _SUFFIX:
        reasons.append(f"activations in {dtype} (the kernel reads bfloat16 and float32)")
    if weight.block % SUB_BLOCK:
        reasons.append(f"blocks of {weight.block}, not a multiple of {SUB_BLOCK}")
    if weight.packed.device.type != "cpu":
        reasons.append("weights not on the CPU")
    return reasons


class PackedFp4(Layer):
    """An :class:`~engine.layers.fp4.Fp4Weight` for the kernel: ``self(x)`` is x · wᵀ in
    ``dtype``, summed in float32. ``portable=True`` runs the plain-C build (tests)."""

    def __init__(self, weight: Fp4Weight, dtype: torch.dtype, portable: bool = False):
        super().__init__()
        reasons = unpackable(weight, dtype)
        if reasons:
            raise ValueError(f"cannot pack this weight: {'; '.join(reasons)}")
        self.dtype, self.block = dtype, weight.block
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", weight.packed.contiguous())
        self.register_buffer("scale", weight.scale.float().contiguous())
        bound, suffix = kernels(portable), _SUFFIX[dtype]
        self._matmul, self._dequantize = bound[f"fp4_matmul_{suffix}"], bound[f"fp4_dequantize_{suffix}"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = activation_rows(x, self.in_features, self.dtype)
        out = torch.empty(x.shape[0], self.out_features, dtype=self.dtype)
        self._matmul(
            x.data_ptr(),
            x.stride(0),
            x.shape[0],
            self.in_features,
            self.packed.data_ptr(),
            self.scale.data_ptr(),
            self.block,
            self.out_features,
            out.data_ptr(),
        )
        return out

    def dequantize(self) -> torch.Tensor:
        out = torch.empty(self.out_features, self.in_features, dtype=self.dtype)
        self._dequantize(
            self.packed.data_ptr(),
            self.scale.data_ptr(),
            self.block,
            self.in_features,
            self.out_features,
            out.data_ptr(),
        )
        return out
