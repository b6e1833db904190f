"""Group-affine weights on the VNNI or AVX2 kernel (``quant_gemm.c``): int8 activations ×
4-bit or 8-bit unsigned weights, one scale and offset per 32 inputs.

:class:`PackedAffine` is what :meth:`NativeLayerOps.pack_affine` returns: the weight repacked
once into the kernel's layout, a matmul (``forward``) and row lookups (``rows``) in one module.
Activations are rounded to int8 per row and per 32 inputs (llama.cpp's q8_1 activations, the
group's sum taken from the rounded values, as ``quant_gemm.c`` explains), so results are the
rounded activations times the exact weight (relative error ~0.4 % of a row's magnitude per
group).

On a CPU with AMX tiles, steps of more than ``TILE_ROWS`` rows go another way
(``affine_matmul_amx``, quant_gemm_amx.h): each thread dequantizes a panel of 32 output
columns to bf16 B tiles and multiplies every row of bf16 activations against it on the tiles.
Its cost past the weight's bytes is the dequantization, the same whatever the rows, so below
~12 rows the int8 kernel wins, and from 16 the tiles do. Measured against this kernel and
oneDNN's prepacked bf16 GEMM on the dequantized weight (which reads four times the bytes),
weights cycled through 60 layers so that they come from memory as in a step, two threads, µs
per call (``quant_matmul.py --layers 60``; an Emerald Rapids Xeon, 2026-12-05; the tiles' first
version, whose fused multiply-add the exact weights now cost ~10 % of at 64 rows):

    gate|up 3072×576, M = 16 / 64 / 256:   tiles 82 / 215 / 481   int8 105 / 315 / 1066   bf16 149 / 237 / 432
    down 576×1536,    M = 16 / 64 / 256:   tiles 40 / 77 / 184    int8 50 / 163 / 613     bf16 62 / 122 / 278

and against dequantizing per call then ``F.linear`` on prefill chunks: 2.2× at 512 rows, level at
2048. So on AMX no dense copy of the weight is kept. A row's result on the tiles does not
depend on its batch, but it is not the int8 kernel's: ``ENGINE_CPU_AMX_TILES=0`` keeps every
step on that kernel. Without AMX the bf16 GEMM is no faster than this kernel at any size
measured (1.09–1.11× at 512 and 2048 rows), and there is no other path.
"""

from __future__ import annotations

import functools

import torch

from engine.layers import Layer
from engine.layers.group_affine import AffineWeight
from engine.native import load_source
from engine.native.tape import NativeKernel, bind
from engine_platforms_cpu_native import kernels
from engine_platforms_cpu_native.kernels import activation_rows, tiles_allowed
from engine_platforms_cpu_native.logits import Int8Table, int8_tiles

GROUP, TILE = 32, 16
# the logits each row of a vocabulary's matmul gets recomputed exactly (PackedAffine.logits)
LOGITS_REFINED = 32
# the fewest rows whose greedy tokens come from the head without their logits (PackedAffine.greedy)
GREEDY_ROWS = 2
# steps of more rows than this multiply on AMX tiles where the CPU has them (see above): level
# with the int8 kernel at 16, and the native tapes, which record decode steps up to 16 rows,
# replay that kernel
TILE_ROWS = 16
SOURCE = kernels.SOURCE.with_name("quant_gemm.c")
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
# the ggml block layouts packed straight from their blocks: (pack_ggml_blocks' type, bytes per
# block of 32 values, packed bits)
BLOCK_LAYOUTS = {"ggml:q4_0": (0, 18, 4), "ggml:q4_1": (1, 20, 4), "ggml:q8_0": (2, 34, 8)}


@functools.cache
def kernels(portable: bool = False) -> dict[str, NativeKernel]:
    """The kernel's entry points (every function of ``quant_gemm.h``), from this CPU's build or
    the ``portable`` one (plain C), bound so that native tapes record them."""
    library = load_source(SOURCE, portable=portable)
    return {symbol: bind(library, symbol) for symbol in library.prototypes}


def amx_tiles() -> bool:
    """Whether batched steps multiply on AMX tiles: the build has them, Linux granted this
    process their state (``affine_amx``), and ``ENGINE_CPU_AMX_TILES`` is not ``0`` (which
    keeps every step on the int8 kernel, whose rows are the same in any batch)."""
    return tiles_allowed() and bool(kernels()["affine_amx"]())


def unpackable(weight: AffineWeight, dtype: torch.dtype) -> list[str]:
    """Reasons the kernel cannot hold ``weight`` for activations of ``dtype``; empty when it can."""
    reasons = []
    if dtype not in _SUFFIX:
        reasons.append(f"activations in {dtype} (the kernel reads bfloat16 and float32)")
    if weight.group != GROUP:
        reasons.append(f"group size {weight.group}, not {GROUP}")
    if weight.bits > 8:
        reasons.append(f"{weight.bits}-bit values")
    if weight.q.device.type != "cpu":
        reasons.append("weights not on the CPU")
    return reasons


SZ_F32, SZ_F16, SZ_F16_CENTRED = 0, 1, 2  # the forms of the packed scales (quant_gemm.c)


def _sz_form(sz: torch.Tensor, bits: int) -> tuple[int, torch.Tensor]:
    """(form, the buffer kept) for the packed scales and offsets ``sz`` [pairs of tiles, groups,
    2, 2, 16] of ``bits``-bit values: float16 scales alone where every offset is exactly
    -2^(bits-1) times its scale, both float16 where float16 holds them exactly, else float32."""
    half = sz.half()
    if not torch.equal(half.float(), sz):
        return SZ_F32, sz
    if torch.equal(sz[..., 1, :], sz[..., 0, :] * -(2 ** (bits - 1))):
        return SZ_F16_CENTRED, half[..., 0, :].contiguous()
    return SZ_F16, half


class PackedAffine(Layer):
    """An :class:`AffineWeight` in the kernel's layout: ``self(x)`` is x · wᵀ, ``rows(ids)``
    w[ids], both in ``dtype``. 4-bit values take half a byte, 5- to 8-bit ones a byte; the
    scales and offsets are float16 where that holds them exactly (GGUF's Q4_0…Q8_0 store d
    and m as float16: 0.125 B a parameter), else float32 (K-quants' d · 6-bit scale); where
    every offset is -2^(bits-1) · scale (Q4_0 and Q8_0: symmetric values stored unsigned) the
    scales alone are kept (0.0625 B a parameter: the file's own bytes) and the kernel makes
    each offset from its scale, the same float (``form``, quant_gemm.c).
    ``portable=True`` runs the plain-C build (what a CPU without AVX512_VNNI or AVX2 gets), for
    tests; ``tiles=False`` keeps every step on the int8 kernel where AMX tiles would take the
    batched ones (for benchmarks)."""

    def __init__(self, weight: AffineWeight, dtype: torch.dtype, portable: bool = False, tiles: bool = True):
        super().__init__()
        reasons = unpackable(weight, dtype)
        if reasons:
            raise ValueError(f"cannot pack this weight: {'; '.join(reasons)}")
        q, scale, offset = (t.contiguous() for t in (weight.q, weight.scale.float(), weight.offset.float()))
        n, k = weight.shape

        def pack(bound, qw, sz):
            pointers = q.data_ptr(), scale.data_ptr(), offset.data_ptr()
            bound["pack_affine"](*pointers, n, k, self.storage_bits, qw.data_ptr(), sz.data_ptr())

        self._pack(pack, dtype, weight.shape, 4 if weight.bits <= 4 else 8, portable, tiles)

    @classmethod
    def from_blocks(cls, raw: torch.Tensor, layout: str, dtype: torch.dtype) -> PackedAffine:
        """The weight of ggml blocks ``raw`` (uint8 [N, bytes per row], ``layout`` one of
        :data:`BLOCK_LAYOUTS`), packed straight from them: the same buffers as
        ``PackedAffine(the blocks' AffineWeight, dtype)`` without the unpacked copy."""
        code, block_bytes, bits = BLOCK_LAYOUTS[layout]
        raw = raw.contiguous()
        n, k = raw.shape[0], raw.shape[1] // block_bytes * GROUP
        self = cls.__new__(cls)
        Layer.__init__(self)

        def pack(bound, qw, sz):
            bound["pack_ggml_blocks"](raw.data_ptr(), code, n, k, qw.data_ptr(), sz.data_ptr())

        self._pack(pack, dtype, (n, k), bits, portable=False, tiles=True)
        return self

    def _pack(self, pack, dtype, shape: tuple[int, int], storage_bits: int, portable: bool, tiles: bool):
        """Allocate the packed buffers, fill them (``pack(kernels, qw, sz)``) and bind the kernels."""
        self.dtype, self.storage_bits = dtype, storage_bits
        (self.out_features, self.in_features), pairs = shape, -(-shape[0] // (2 * TILE))  # tiles in pairs
        qw = torch.empty(pairs * 2 * TILE * self.in_features * self.storage_bits // 8, dtype=torch.uint8)
        sz = torch.empty(pairs, self.in_features // GROUP, 2, 2, TILE)
        bound = kernels(portable)
        pack(bound, qw, sz)
        self.form, kept = _sz_form(sz, storage_bits)
        self.register_buffer("qw", qw)
        self.register_buffer("sz", kept)
        suffix = _SUFFIX[dtype]
        self._bound = bound
        self._matmul, self._rows = bound[f"affine_matmul_{suffix}"], bound[f"affine_rows_{suffix}"]
        self._dequantize = bound[f"affine_dequantize_{suffix}"]
        self._logits = bound[f"affine_logits_{suffix}"]
        self._refine_logits = bound[f"affine_refine_logits_{suffix}"]
        self._greedy = bound[f"affine_greedy_{suffix}"]
        self._greedy_rows = bound[f"affine_greedy_rows_{suffix}"]
        self._settle = bound[f"affine_settle_{suffix}"]
        on_amx = tiles and dtype == torch.bfloat16 and not portable and amx_tiles()
        self._tiles = bound["affine_matmul_amx"] if on_amx else None
        self.int8_table: Int8Table | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = activation_rows(x, self.in_features, self.dtype)
        if self._on_tiles(x):
            return self._run(self._tiles, x, self.dtype, 0)
        return self._run(self._matmul, x, self.dtype)

    def tiles(self, x: torch.Tensor) -> torch.Tensor:
        """x · wᵀ on the AMX tiles at any number of rows (what ``forward`` runs above
        ``TILE_ROWS``), for a weight that is ``on_tiles``."""
        return self._run(self._tiles, activation_rows(x, self.in_features, self.dtype), self.dtype, 0)

    def prepare_logits(self) -> None:
        """Called once for a vocabulary table, before its first ``logits``: where this CPU
        has AMX int8 tiles too, the batched steps' logits then come from an int8 copy of the
        table (:class:`~engine_platforms_cpu_native.logits.Int8Table`: ``int8_table``)."""
        if self.on_tiles and self.int8_table is None and int8_tiles():
            self.int8_table = Int8Table(
                lambda ids: self.rows(ids, torch.float32), self.out_features, self.in_features
            )

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` for a vocabulary table's logits, in float32, with each row's
        ``LOGITS_REFINED`` largest recomputed from the activations unrounded (``affine_logits``):
        the int8 rounding's error reaches the logits with no normalization after. On the
        default model the int8 head was a third of the float32 path's KL divergence from the
        reference (docs/decisions.md). Steps on AMX tiles take float32 logits from the int8
        copy (``prepare_logits``) or else the tiles' product of the bf16 weight, refined the
        same way (``affine_refine_logits``)."""
        x = activation_rows(x, self.in_features, self.dtype)
        if self._on_tiles(x):
            return self._tile_logits(x)
        return self._kernel_logits(x)

    def _kernel_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``logits`` of a step on the int8 kernel, at any number of rows."""
        return self._run(self._logits, x, torch.float32, LOGITS_REFINED)

    def _tile_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``logits`` of a step on the tiles, at any number of rows: a row's values are the same
        whatever rows come with it."""
        if self.int8_table is not None:
            out = self.int8_table(x)
        else:
            out = self._run(self._tiles, x, torch.float32, 1)
        return self._run(self._refine_logits, x, torch.float32, LOGITS_REFINED, out=out)

    def greedy(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each row's first maximum of ``logits(x)`` (int64 [M]), the same token; None for a
        single row (whose 200 KB of logits stay in cache: the kernel's path took 348 µs a call
        with the argmax against 363 here, where from 4 rows this is 12-17 % faster, 2x at 256)
        and where a step's logits come from the tiles' product of the bf16 weight (no int8
        copy): the caller then takes the logits' argmax.

        Why: a greedy step reads a row's largest logits only, yet ``logits`` writes all of them
        (50 MB at 256 rows of a 49k vocabulary), the refinement reads them back for each row's
        ``LOGITS_REFINED`` largest and the sampler once more for the maximum. Here the product
        keeps each row's largest as it goes (``Int8Table.top`` on AMX, ``affine_logits_top`` on
        VNNI; a build without VNNI writes its logits and passes over them once), writing no logit,
        and ``affine_greedy`` recomputes those exactly, as the refinement does: the largest is the
        row's maximum where it lies above the least of the candidates' one-pass values, which no
        logit left out exceeds. A row where it does not (a flat row, NaN) gets its logits made as
        ``logits`` makes them, and their first maximum. Off the tiles that is one kernel call
        (``affine_greedy_rows``); on them four (the int8 copy's candidates, ``affine_greedy``,
        the unsettled rows' logits, ``affine_settle``), whatever the rows need: no branch in
        Python, so a native tape records either."""
        x = activation_rows(x, self.in_features, self.dtype)
        if x.shape[0] < GREEDY_ROWS:
            return None
        top = min(LOGITS_REFINED, self.out_features)
        tokens = torch.empty(x.shape[0], dtype=torch.int64)
        if not self._on_tiles(x):
            return self._run(self._greedy_rows, x, torch.int64, top, out=tokens)
        if self.int8_table is None:
            return None
        best, approx = self.int8_table.top(x, top)
        self._run(self._greedy, x, torch.int64, top, best.data_ptr(), approx.data_ptr(), out=tokens)
        logits = torch.empty(x.shape[0], self.out_features)  # only unsettled rows' are written
        self.int8_table.unsettled(x, tokens, logits)
        return self._run(self._settle, x, torch.int64, top, logits.data_ptr(), out=tokens)

    @property
    def on_tiles(self) -> bool:
        """Whether steps of more than ``TILE_ROWS`` rows multiply on AMX tiles."""
        return self._tiles is not None

    def invariant_at_any_rows(self) -> PackedAffine:
        """This weight with every step on the int8 kernel, so ``invariant_rows`` is None: under
        ``--batch-invariant`` the tiles would take no step anyway (their rows' bits differ from
        a row's alone, so a batched step ran in 16-row calls), and one call a step streams the
        weight once and is taped. Call it before ``prepare_logits`` (then no int8 copy)."""
        self._tiles = None
        return self

    @property
    def invariant_rows(self) -> int | None:
        """The most rows a call of ``forward``, ``logits`` or ``greedy`` may take and still give
        each row the bits it gets alone (None: any number): the int8 kernel rounds and sums
        each row on its own, and so do the tiles, but the two differ, so a weight on tiles
        keeps that only up to ``TILE_ROWS``."""
        return TILE_ROWS if self.on_tiles else None

    def _on_tiles(self, x: torch.Tensor) -> bool:
        return self.on_tiles and x.shape[0] > TILE_ROWS

    def _run(self, kernel, x: torch.Tensor, dtype: torch.dtype, *extra, out=None) -> torch.Tensor:
        """``kernel`` over the activation rows x and the packed weight, into ``out`` or a fresh
        [M, N] of ``dtype``; ``extra`` goes between the weight's arguments and the output's."""
        if out is None:
            out = torch.empty(x.shape[0], self.out_features, dtype=dtype)
        kernel(
            x.data_ptr(),
            x.stride(0),
            x.shape[0],
            self.in_features,
            self.qw.data_ptr(),
            self.sz.data_ptr(),
            self.form,
            self.storage_bits,
            self.out_features,
            *extra,
            out.data_ptr(),
        )
        return out

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """w[ids] in ``dtype`` (default: this packing's)."""
        kernel = self._rows if dtype is None else self._bound[f"affine_rows_{_SUFFIX[dtype]}"]
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.shape[0], self.in_features, dtype=dtype or self.dtype)
        if kernel(
            self.qw.data_ptr(),
            self.sz.data_ptr(),
            self.form,
            self.storage_bits,
            self.in_features,
            self.out_features,
            flat.data_ptr(),
            flat.shape[0],
            out.data_ptr(),
        ):
            raise IndexError(f"row ids must lie in [0, {self.out_features})")
        return out.view(*ids.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        out = torch.empty(self.out_features, self.in_features, dtype=self.dtype)
        self._dequantize(
            self.qw.data_ptr(),
            self.sz.data_ptr(),
            self.form,
            self.storage_bits,
            self.in_features,
            self.out_features,
            out.data_ptr(),
        )
        return out
