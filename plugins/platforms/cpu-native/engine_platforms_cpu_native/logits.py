"""A vocabulary table's batched logits on AMX int8 tiles (``logits_int8.c``).

The LM head of a batched step on the group-affine tiles (``affine_matmul_amx``) spends about
half its time dequantizing the table to bf16, work the tiles do not overlap. :class:`Int8Table`
keeps a second copy of the table rounded to int8 with one scale a row (k bytes a row: 27 MiB
for the default model's 49 152 × 576, 251 MiB for a 128 256 × 2 048 one) and multiplies it with
the activations split per row into two int8 halves (~16 bits of each value), on ``tdpbssd``
with one scaling per logit at the end. Each row's largest logits are then recomputed exactly
from the packed table (``PackedAffine.logits``), so the copy's rounding reaches only the logits
sampling rarely looks at: on 32 windows of the held text the default model's mean KL divergence
from the float32 reference went from 0.00064 to 0.00087, top-1 unchanged (docs/decisions.md,
"The LM head on int8 tiles").

Measured on an Emerald Rapids Xeon (2 cores), the default model's head product at 64 rows took
1.7 ms against the bf16 tiles' 2.4, and the decode step 1.03–1.04× less time (benchmarks/
RESULTS.md, same title). At 256 rows both were bound by writing 50 MB of float32 logits (9.9
against 10.5 ms); logits over 32 MiB now go past the caches (``logits_int8.c``'s
``STREAM_BYTES``), 8.9–9.1 against 11.6–12.9 ms in the step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from engine.layers import Layer
from engine.native import load_source
from engine.native.tape import NativeKernel, bind
from engine_platforms_cpu_native import kernels
from engine_platforms_cpu_native.kernels import activation_rows, tiles_allowed

SOURCE = kernels.SOURCE.with_name("logits_int8.c")
PACK_ROWS = 4096  # table rows read as float32 at a time while packing (16 MiB at k = 1 024)


@functools.cache
def kernels(portable: bool = False) -> dict[str, NativeKernel]:
    """Every function of ``logits_int8.h``, from this CPU's build or the ``portable`` one (plain C)."""
    library = load_source(SOURCE, portable=portable)
    return {symbol: bind(library, symbol) for symbol in library.prototypes}


def int8_tiles() -> bool:
    """Whether this build and process multiply on AMX int8 tiles and ``ENGINE_CPU_AMX_TILES``
    is not ``0``."""
    return tiles_allowed() and bool(kernels()["logits_int8_amx"]())


class Int8Table(Layer):
    """A vocabulary table of ``n`` rows and ``k`` inputs rounded to int8 per row: ``self(x)`` is
    float32 [M, n] ≈ x · wᵀ for bf16 rows x. ``float_rows(ids)`` gives the table's exact rows in
    float32 (read ``PACK_ROWS`` at a time). ``portable=True`` runs the plain-C build."""

    batched_only = True  # single-stream decode never reads it (benchmarks/bandwidth_floor.py)

    def __init__(
        self, float_rows: Callable[[torch.Tensor], torch.Tensor], n: int, k: int, portable: bool = False
    ):
        super().__init__()
        self.out_features, self.in_features = n, k
        self._kernels = kernels(portable)
        w8 = torch.zeros(self._kernels["logits_int8_bytes"](n, k), dtype=torch.int8)
        scale = torch.empty(n)
        pack = self._kernels["logits_int8_pack"]
        for row0 in range(0, n, PACK_ROWS):
            rows = float_rows(torch.arange(row0, min(row0 + PACK_ROWS, n))).float().contiguous()
            pack(rows.data_ptr(), row0, rows.shape[0], k, w8.data_ptr(), scale.data_ptr())
        self.register_buffer("w8", w8)
        self.register_buffer("scale", scale)

    @property
    def nbytes(self) -> int:
        return self.w8.numel() + self.scale.numel() * 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = activation_rows(x, self.in_features, torch.bfloat16)
        out = torch.empty(x.shape[0], self.out_features)
        self._run("logits_int8", x, out.data_ptr())
        return out

    def top(self, x: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's ``top`` (1 ≤ top ≤ min(n, 64)) largest logits of ``self(x)`` — their
        columns (int64 [M, top]) and values (float32 [M, top]), in no order — without writing
        the others: the entries a pass over the row keeps, ranked by value, then the lower
        column first; NaN values for a row it cannot rank (more equal values than it keeps, or
        NaN)."""
        x = activation_rows(x, self.in_features, torch.bfloat16)
        best = torch.empty(x.shape[0], top, dtype=torch.int64)
        values = torch.empty(x.shape[0], top)
        self._run("logits_int8_top", x, top, best.data_ptr(), values.data_ptr())
        return best, values

    def unsettled(self, x: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor) -> None:
        """``self(x)``'s rows whose token is -1 (int64 ``tokens`` [M]: a row ``top``'s
        candidates could not settle) into float32 ``out`` [M, n], whose other rows are not
        written: a kernel call whatever the tokens, so that a native tape records it."""
        x = activation_rows(x, self.in_features, torch.bfloat16)
        self._run("logits_int8_unsettled", x, tokens.data_ptr(), out.data_ptr())

    def _run(self, name: str, x: torch.Tensor, *outputs) -> None:
        """Kernel ``name`` over the bf16 rows x and the table; ``outputs`` follow the table's."""
        self._kernels[name](
            x.data_ptr(),
            x.stride(0),
            x.shape[0],
            self.in_features,
            self.w8.data_ptr(),
            self.scale.data_ptr(),
            self.out_features,
            *outputs,
        )
