"""bfloat16 weights on cpu-native's own kernels: :class:`TiledBf16` on a CPU with AMX tiles,
:class:`WidenedBf16` on one that cannot compute bfloat16 (AVX2 + FMA without AVX512_BF16 or
AMX), where oneDNN declines to prepack them (:func:`engine.layers.dense.packable`) and torch's
bfloat16 ``F.linear`` is oneDNN's emulation. :class:`WidenedBf16` keeps the weight as it is
(2 B a parameter) and multiplies it on ``dense_bf16.c``'s kernel: each weight widened to float32
as it is read, summed in float32, one C call (so native tapes record it) at every batch size.

Measured on an AVX2 EPYC (benchmarks/RESULTS.md, 2026-12-05), the kernel took less time than the
emulated ``F.linear`` at every shape of the default and 1B-class models: 1.5-2.3× at one row and
3.3-5.9× at 4-16 on one thread, 3.1-6.1× from 64 rows on the 1B-class shapes on two. Float32
GEMM (MKL) over the weight widened panel by panel into a scratch was up to 1.4× faster than the
kernel at 256 rows on one thread, but slower at every size on two (a parallel region per panel),
so it was not kept.

From ``dense_tiled_min_rows()`` rows (32: prompt chunks, where the call is compute-bound) the
kernel runs register tiles of 4 rows × 3 columns over cache blocks instead of its 2-row blocks,
each output summed in the very same float32 order, so a row's bits do not depend on its batch
(the ``pack_dense`` contract, batch-invariant mode). Against the 2-row blocks on the same AVX2
EPYC, quiet: 1.17-1.34× from 64 rows on one thread, 1.16-1.66× at 64-1024 rows on two, on every
shape of the default and 1B-class models (benchmarks/RESULTS.md, 2026-12-05, issue 24).
"""

from __future__ import annotations

import functools

import torch

from engine.layers import Layer
from engine.native import load_source
from engine.native.tape import NativeKernel, bind
from engine_platforms_cpu_native import kernels
from engine_platforms_cpu_native.kernels import activation_rows, tiles_allowed

SOURCE = kernels.SOURCE.with_name("dense_bf16.c")
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


@functools.cache
def kernels(portable: bool = False) -> dict[str, NativeKernel]:
    """Every function of ``dense_bf16.h``, from this CPU's build or the ``portable`` one (plain C)."""
    library = load_source(SOURCE, portable=portable)
    return {symbol: bind(library, symbol) for symbol in library.prototypes}


def unpackable(weight: torch.Tensor, dtype: torch.dtype) -> list[str]:
    """Reasons the kernel cannot hold ``weight`` for activations of ``dtype``; empty when it can."""
    reasons = []
    if dtype not in _SUFFIX:
        reasons.append(f"activations in {dtype} (the kernel reads bfloat16 and float32)")
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        reasons.append(f"a {weight.dim()}-d {weight.dtype} weight, not a 2-d bfloat16 one")
    if weight.device.type != "cpu":
        reasons.append("weight not on the CPU")
    return reasons


class _HeldBf16(Layer):
    """A bfloat16 weight [N, K] kept as the checkpoint holds it, multiplied by a ``dense_bf16.h``
    entry point (``self._matmul``, set by the subclass): ``self(x, bias)`` = x · wᵀ (+ bias) for
    x [..., K] in ``self.dtype``; ``dequantize()`` = w, exact."""

    _matmul: NativeKernel
    # each row summed in the same steps whatever rows share the call (the widening kernel's
    # register tiles and the AMX tiles alike), which ``--batch-invariant`` then relies on
    invariant_rows = None

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        reasons = unpackable(weight, dtype)
        if reasons:
            raise ValueError(f"cannot hold this weight: {'; '.join(reasons)}")
        self.dtype = dtype
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach().contiguous())

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x = activation_rows(x, self.in_features, self.dtype)
        if bias is not None:
            bias = bias.to(self.dtype).contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=self.dtype)
        self._matmul(
            x.data_ptr(),
            x.stride(0),
            x.shape[0],
            self.in_features,
            self.weight.data_ptr(),
            0 if bias is None else bias.data_ptr(),
            self.out_features,
            out.data_ptr(),
        )
        return out.view(*lead, self.out_features)

    def dequantize(self) -> torch.Tensor:
        return self.weight


class WidenedBf16(_HeldBf16):
    """The widening kernel: x in ``dtype`` (bfloat16 or float32), summed in float32 and rounded
    once. ``portable=True`` runs the plain-C build (tests)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, portable: bool = False):
        super().__init__(weight, dtype)
        self._matmul = kernels(portable)[f"dense_matmul_{_SUFFIX[dtype]}"]


def amx_tiles() -> bool:
    """Whether bfloat16 weights multiply on AMX tiles: the build has them, Linux granted this
    process their state (``dense_amx``), and ``ENGINE_CPU_AMX_TILES`` is not ``0`` (which
    leaves them to oneDNN)."""
    return tiles_allowed() and bool(kernels()["dense_amx"]())


class TiledBf16(_HeldBf16):
    """bfloat16 weights on AMX tiles as the checkpoint holds them (``dense_bf16_amx.h``):
    ``self(x, bias)`` = x · wᵀ (+ bias) for bfloat16 x [..., K], summed in float32 in 32-input
    steps, the same steps at any batch (a row's bits do not depend on it); ``dequantize()`` = w.
    Without AMX (the ``portable=True`` build, for tests) the same call sums as
    :class:`WidenedBf16` does.

    Why not oneDNN's prepacked GEMM, which the plain ops take on a CPU that computes bfloat16:
    a decode step is then one C call a projection, so a native tape records the whole step (a
    oneDNN call left the bf16 config's decode eager), and the kernel streamed the default and
    1B-class models' projections from memory at 1-16 rows 1.07-1.36× faster than oneDNN (level
    on the 1B-class down projection), 0.99-1.18× at 64 rows and 0.85-1.03× at 256, where the
    products bind. An Emerald Rapids Xeon, two threads, 2026-12-05 (benchmarks/RESULTS.md,
    "bf16 weights on AMX tiles")."""

    def __init__(self, weight: torch.Tensor, portable: bool = False):
        super().__init__(weight, torch.bfloat16)
        self._matmul = kernels(portable)["dense_matmul_amx"]
