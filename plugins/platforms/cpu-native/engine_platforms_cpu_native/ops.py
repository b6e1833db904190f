"""LayerOps on the fused C kernels: (residual add +) RMSNorm, the rotary tables' lookup by
position, rotary embedding and Qwen3's per-head q/k RMSNorm + rotary in place, W8A8's activation
quantization and int32 rescale and SwiGLU in one pass each, LoRA's grouped shrink and expand
(one call each per layer, whatever the mix of adapters), and group-affine weights (GGUF's
32-group formats) on the VNNI or AVX2 kernel of :mod:`engine_platforms_cpu_native.affine`, and FP4
weights with float block scales (NVFP4) on :mod:`engine_platforms_cpu_native.fp4`.

Each call is one ctypes call on the tensors' memory where the torch path makes several torch
calls, typed by the prototypes of ``kernels.h``. The kernels are bound with
:func:`engine.native.tape.bind`, so a decode step made of them
(and of the cpu-native attention and affine kernels) is recorded onto a native tape. The kernels
are vectorized and split a big batch's rows (prefill chunks) over the threads, so they take any
batch; dtypes or layouts they do not take go to the torch path.
"""

from __future__ import annotations

import functools
import itertools

import torch

from engine.layers import LayerOps
from engine.native import BuildError, Library
from engine.native.tape import bind
from engine_platforms_cpu_native import affine, dense, fp4

# each <name>_bf16 and <name>_f32 in kernels.h
_TYPED_KERNELS = (
    "add_rms_norm",
    "rms_norm",
    "rotary",
    "qk_norm_rotary",
    "quantize_rows_int8",
    "rescale_int32",
    "silu_and_mul",
    "lora_shrink",
    "lora_expand",
)
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
_NO_OUTLIERS = torch.empty(0, dtype=torch.long)


def _simd(kernels, width: str) -> bool:
    """Whether ``kernels()`` (a weight kernel's entry points) have a SIMD build here, by its
    ``width`` entry point: their portable C builds are for tests (slower than torch's paths)."""
    try:
        return bool(kernels()[width]())
    except (BuildError, OSError):
        return False


class NativeLayerOps(LayerOps):
    name = "cpu-native"
    # each kernel computes a row from that row alone, the same way whatever the row count (the
    # threads split whole rows); which path an op takes depends on dtypes and layouts, never on
    # how many rows there are (``_takes``)
    row_invariant = True

    def __init__(self, library: Library, dtype: torch.dtype):
        self.dtype = dtype
        self.max_rotary_dim = library.max_rotary_dim()
        self.max_lora_rank = library.lora_max_rank()
        self._kernels = {
            (name, dtype): bind(library, f"{name}_{suffix}")
            for name in _TYPED_KERNELS
            for dtype, suffix in _SUFFIX.items()
        }
        self._gather = bind(library, "gather_rows")

    def pack_dense(self, weight):
        """Where this CPU has AMX tiles, a :class:`~engine_platforms_cpu_native.dense.TiledBf16`
        for bfloat16 (the weight as it lies, on the tiles: tape-recordable, and faster than
        oneDNN at decode steps); elsewhere oneDNN's packed bfloat16 where this CPU computes
        bfloat16 (the plain ops'), or with AVX2 and FMA a
        :class:`~engine_platforms_cpu_native.dense.WidenedBf16` (the weight widened to float32 as
        it is read, in place of oneDNN's bfloat16 emulation); else None."""
        if self.dtype == torch.bfloat16 and not dense.unpackable(weight, self.dtype) and dense.amx_tiles():
            return dense.TiledBf16(weight)
        packed = super().pack_dense(weight)
        if packed is not None or dense.unpackable(weight, self.dtype):
            return packed
        return dense.WidenedBf16(weight, self.dtype) if _simd(dense.kernels, "dense_simd_width") else None

    def pack_affine(self, weight):
        """A :class:`~engine_platforms_cpu_native.affine.PackedAffine` where this CPU has
        AVX512_VNNI or AVX2 and the weight has 32-element groups of at most 8 bits; else None
        (the portable C path is slower than torch's int4pack, so it is not offered)."""
        if affine.unpackable(weight, self.dtype) or not _simd(affine.kernels, "affine_simd_width"):
            return None
        return affine.PackedAffine(weight, self.dtype)

    def pack_affine_blocks(self, parts, layout):
        """:meth:`pack_affine` of ggml's legacy q4_0, q4_1 and q8_0 blocks, packed in C straight
        from the file's bytes (as ``pack_affine`` would pack their weight)."""
        if layout not in affine.BLOCK_LAYOUTS or self.dtype not in _SUFFIX:
            return None
        if any(p.device.type != "cpu" for p in parts) or not _simd(affine.kernels, "affine_simd_width"):
            return None
        raw = parts[0] if len(parts) == 1 else torch.cat(parts)
        return affine.PackedAffine.from_blocks(raw, layout, self.dtype)

    def notes(self, model):
        """Which weights multiply on AMX tiles: the packed ones' steps of more than
        :data:`affine.TILE_ROWS` rows (the weight dequantized on the fly), a vocabulary table's
        batched logits on its int8 copy (with that copy's memory), bfloat16 weights always."""
        modules = list(model.modules())
        notes = []
        packed = [m for m in modules if isinstance(m, affine.PackedAffine)]
        if any(m.on_tiles for m in packed):
            notes.append(f"AMX: quantized weights multiply steps over {affine.TILE_ROWS} rows on AMX tiles")
        copies = [m.int8_table for m in packed if m.int8_table is not None]
        if copies:
            copy = f"an int8 copy of its table ({sum(c.nbytes for c in copies) / 2**20:.1f} MiB)"
            notes.append(f"AMX: the LM head's batched steps on int8 tiles, from {copy}")
        if any(isinstance(m, dense.TiledBf16) for m in modules):
            notes.append("AMX: bfloat16 weights multiply on AMX tiles")
        return notes

    def pack_fp4(self, weight):
        """A :class:`~engine_platforms_cpu_native.fp4.PackedFp4` where this CPU has AVX2 and
        FMA and the weight's blocks are multiples of 16 inputs (NVFP4's 16, MXFP4's 32); else
        None (the quant method dequantizes it)."""
        if fp4.unpackable(weight, self.dtype) or not _simd(fp4.kernels, "fp4_simd_width"):
            return None
        return fp4.PackedFp4(weight, self.dtype)

    def _takes(self, x: torch.Tensor) -> bool:
        """Rows [T, K] back to back (``is_contiguous`` would also pass one row of a wider
        buffer, and its neighbours would then meet torch's path)."""
        return x.dtype == self.dtype and x.dim() == 2 and x.stride(1) == 1 and x.stride(0) == x.shape[1]

    def rms_norm(self, norm, x, residual=None):
        if not (self._takes(x) and (residual is None or self._takes(residual))):
            return super().rms_norm(norm, x, residual)
        if residual is None:
            out = torch.empty(x.shape, dtype=x.dtype)
            self._kernels["rms_norm", self.dtype](
                x.data_ptr(), norm.weight.data_ptr(), x.shape[0], x.shape[1], norm.eps, out.data_ptr()
            )
            return out
        self._kernels["add_rms_norm", self.dtype](
            x.data_ptr(), residual.data_ptr(), norm.weight.data_ptr(), x.shape[0], x.shape[1], norm.eps
        )
        return x, residual

    def gather_rows(self, table, ids):
        if not (
            table.is_contiguous() and ids.dtype == torch.int64 and ids.dim() == 1 and ids.is_contiguous()
        ):
            return super().gather_rows(table, ids)
        out = torch.empty((ids.shape[0], *table.shape[1:]), dtype=table.dtype)
        if self._gather(
            table.data_ptr(),
            table.shape[0],
            table[0].numel() * table.element_size(),
            ids.data_ptr(),
            ids.shape[0],
            out.data_ptr(),
        ):
            raise IndexError(f"row ids must lie in [0, {table.shape[0]})")
        return out

    def _takes_rotary(self, qkv, head_dim, cos_sin) -> bool:
        """Rows [T, width] of contiguous heads (the row stride may be padded), with cos/sin
        tables [T, 1, D] as the rotary gives."""
        cos, sin = cos_sin
        return (
            qkv.dtype == self.dtype
            and qkv.dim() == 2
            and qkv.stride(-1) == 1
            and head_dim <= self.max_rotary_dim
            and cos.is_contiguous()
            and sin.is_contiguous()
        )

    def rotary_qkv(self, qkv, num_heads, num_kv_heads, head_dim, cos_sin):
        if not self._takes_rotary(qkv, head_dim, cos_sin):
            return super().rotary_qkv(qkv, num_heads, num_kv_heads, head_dim, cos_sin)
        cos, sin = cos_sin
        rotary = self._kernels["rotary", self.dtype]
        rotary(
            qkv.data_ptr(),
            qkv.shape[0],
            qkv.stride(0),
            num_heads + num_kv_heads,
            head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
        )
        return qkv.view(qkv.shape[0], -1, head_dim).split([num_heads, num_kv_heads, num_kv_heads], dim=1)

    def qk_norm_rotary(self, qkv, q_norm, k_norm, num_heads, num_kv_heads, head_dim, cos_sin):
        weights = (q_norm.weight, k_norm.weight)
        if not (
            self._takes_rotary(qkv, head_dim, cos_sin)
            and all(w.dtype == self.dtype and w.is_contiguous() for w in weights)
        ):
            return super().qk_norm_rotary(qkv, q_norm, k_norm, num_heads, num_kv_heads, head_dim, cos_sin)
        cos, sin = cos_sin
        self._kernels["qk_norm_rotary", self.dtype](
            qkv.data_ptr(),
            qkv.shape[0],
            qkv.stride(0),
            num_heads,
            num_kv_heads,
            head_dim,
            q_norm.weight.data_ptr(),
            k_norm.weight.data_ptr(),
            q_norm.eps,
            k_norm.eps,
            cos.data_ptr(),
            sin.data_ptr(),
        )
        return qkv.view(qkv.shape[0], -1, head_dim).split([num_heads, num_kv_heads, num_kv_heads], dim=1)

    def silu_and_mul(self, x):
        if not (x.dtype == self.dtype and x.dim() == 2 and x.stride(-1) == 1):
            return super().silu_and_mul(x)
        width = x.shape[1] // 2
        out = torch.empty(x.shape[0], width, dtype=x.dtype)
        self._kernels["silu_and_mul", self.dtype](
            x.data_ptr(), x.shape[0], x.stride(0), width, out.data_ptr()
        )
        return out

    def quantize_rows_int8(self, x, outlier_threshold):
        if not self._takes(x):
            return super().quantize_rows_int8(x, outlier_threshold)
        rows, cols = x.shape
        xq, scale = torch.empty(rows, cols, dtype=torch.int8), torch.empty(rows, 1)
        flagged = torch.empty(cols, dtype=torch.uint8)
        count = self._kernels["quantize_rows_int8", self.dtype](
            x.data_ptr(), rows, cols, outlier_threshold, xq.data_ptr(), scale.data_ptr(), flagged.data_ptr()
        )
        return xq, scale, (flagged.nonzero().flatten() if count else _NO_OUTLIERS)

    def rescale_int32(self, acc, row_scale, col_scale, dtype):
        if (
            dtype not in _SUFFIX
            or not acc.is_contiguous()
            or not (row_scale.is_contiguous() and col_scale.is_contiguous())
        ):
            return super().rescale_int32(acc, row_scale, col_scale, dtype)
        out = torch.empty(acc.shape, dtype=dtype)
        self._kernels["rescale_int32", dtype](
            acc.data_ptr(),
            acc.shape[0],
            acc.shape[1],
            row_scale.data_ptr(),
            col_scale.data_ptr(),
            out.data_ptr(),
        )
        return out

    def _takes_lora(self, indices, rows, *weights) -> bool:
        """``rows`` (x or y) [T, width] with unit column stride, contiguous weights, all in this
        ops' dtype; int64 indices."""
        return (
            indices.dtype == torch.int64
            and indices.is_contiguous()
            and rows.dim() == 2
            and rows.stride(-1) == 1
            and all(t.dtype == self.dtype for t in (rows, *weights))
            and all(w.is_contiguous() for w in weights)
        )

    def lora_shrink(self, x, a, scale, indices, ranks=None):
        slots, shards, rank, cols = a.shape
        if ranks is None:
            ranks = _full_ranks(slots, shards, rank)
        if not (
            self._takes_lora(indices, x, a)
            and scale.dtype == torch.float32
            and scale.is_contiguous()
            and ranks.dtype == torch.int64
            and ranks.is_contiguous()
        ):
            return super().lora_shrink(x, a, scale, indices, ranks)
        h = torch.empty(x.shape[0], shards, rank, dtype=x.dtype)
        if self._kernels["lora_shrink", self.dtype](
            x.data_ptr(),
            x.shape[0],
            x.stride(0),
            cols,
            a.data_ptr(),
            slots,
            shards,
            rank,
            scale.data_ptr(),
            ranks.data_ptr(),
            indices.data_ptr(),
            h.data_ptr(),
        ):
            raise IndexError(f"LoRA slots must lie in [-1, {slots}) and ranks in [0, {rank}]")
        return h

    def lora_expand(self, y, h, b, indices, output_sizes):
        slots, rank, width = b.shape
        if rank > self.max_lora_rank or not self._takes_lora(indices, y, h, b):
            return super().lora_expand(y, h, b, indices, output_sizes)
        if self._kernels["lora_expand", self.dtype](
            y.data_ptr(),
            y.shape[0],
            y.stride(0),
            h.data_ptr(),
            b.data_ptr(),
            slots,
            len(output_sizes),
            rank,
            width,
            _bounds(tuple(output_sizes)).data_ptr(),
            indices.data_ptr(),
        ):
            raise IndexError(f"LoRA slots must lie in [-1, {slots})")
        return y


@functools.cache
def _full_ranks(slots: int, shards: int, rank: int) -> torch.Tensor:
    """Every slot's shards at the slots' full rank, for a caller that gives no ranks; one
    tensor per shape, kept (a native tape holds its address)."""
    return torch.full((slots, shards), rank, dtype=torch.int64)


@functools.cache
def _bounds(output_sizes: tuple[int, ...]) -> torch.Tensor:
    """The fused shards' column bounds, int64 [n + 1], made once per layer shape (a layer's
    first call is an eager warm-up, before any native tape records it)."""
    return torch.tensor([0, *itertools.accumulate(output_sizes)], dtype=torch.int64)
