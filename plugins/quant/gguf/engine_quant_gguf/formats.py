"""GGUF block formats as group-wise affine weights (``w = q · scale + offset``).

Each reader takes a tensor's raw blocks, uint8 [rows, bytes per row] as ``gguf`` reads them,
and returns an :class:`~engine.layers.group_affine.AffineWeight` that dequantizes to exactly
what ggml's reference dequantizer gives (the tests compare with ``gguf.quants.dequantize``).
"""

from __future__ import annotations

import attrs
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from engine.layers.group_affine import AffineWeight


def _blocks(raw: torch.Tensor, block_bytes: int) -> np.ndarray:
    """The raw bytes as numpy [rows, blocks, block_bytes]: the unpacking below runs in numpy,
    which is 7-40x faster than torch on small uint8 slices (most of a GGUF model's load)."""
    rows = raw.shape[0]
    return raw.numpy().reshape(rows, -1, block_bytes)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per entry on the last axis -> float32 [...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 2n]: the n low nibbles, then the n high nibbles (ggml order)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _finish(q, scale, offset, group, bits) -> AffineWeight:
    rows = q.shape[0]

    def tensor(a, dtype=None):
        return torch.from_numpy(np.ascontiguousarray(a.reshape(rows, -1), dtype=dtype))

    return AffineWeight(tensor(q, np.uint8), tensor(scale), tensor(offset), group, bits)


def _bits(byte_block: np.ndarray, count: int) -> np.ndarray:
    """Little-endian bit ``i`` of a byte string, for i < count -> [..., count] in {0, 1}."""
    shifts = np.arange(8, dtype=np.uint8)
    return ((byte_block[..., :, None] >> shifts) & 1).reshape(*byte_block.shape[:-1], -1)[..., :count]


def q4_0(raw):
    b = _blocks(raw, 18)
    d = _f16(b[..., 0:2])
    return _finish(_nibbles(b[..., 2:]), d, -8 * d, 32, 4)


def q4_1(raw):
    b = _blocks(raw, 20)
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    return _finish(_nibbles(b[..., 4:]), d, m, 32, 4)


def q5_0(raw):
    b = _blocks(raw, 22)
    d = _f16(b[..., 0:2])
    q = _nibbles(b[..., 6:]) | (_bits(b[..., 2:6], 32) << 4)
    return _finish(q, d, -16 * d, 32, 5)


def q5_1(raw):
    b = _blocks(raw, 24)
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    q = _nibbles(b[..., 8:]) | (_bits(b[..., 4:8], 32) << 4)
    return _finish(q, d, m, 32, 5)


def q8_0(raw):
    b = _blocks(raw, 34)
    d = _f16(b[..., 0:2])
    q = np.ascontiguousarray(b[..., 2:]).view(np.int8).astype(np.int16) + 128
    return _finish(q, d, -128 * d, 32, 8)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit (scale, min) pairs of a Q4_K/Q5_K super-block's 12 bytes."""
    s = packed.astype(np.int16)
    low = (s[..., 0:4] & 63, s[..., 4:8] & 63)
    high = ((s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4), (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4))
    scales = np.concatenate([low[0], high[0]], -1).astype(np.float32)
    return scales, np.concatenate([low[1], high[1]], -1).astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 256 values: per 32-byte chunk, its low nibbles then its high nibbles."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack([chunks & 15, chunks >> 4], axis=-2).reshape(*qs.shape[:-1], 256)


def q4_k(raw):
    b = _blocks(raw, 144)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16])
    return _finish(_k_nibbles(b[..., 16:]), d[..., None] * sc, -dmin[..., None] * mn, 32, 4)


def q5_k(raw):
    b = _blocks(raw, 176)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16])
    qh = b[..., 16:48]  # bit j of byte l is the high bit of element 32·j + l
    high = ((qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1).reshape(*qh.shape[:-1], 256)
    q = _k_nibbles(b[..., 48:]) | (high << 4)
    return _finish(q, d[..., None] * sc, -dmin[..., None] * mn, 32, 5)


def q6_k(raw):
    b = _blocks(raw, 210)
    ql, qh = b[..., 0:128], b[..., 128:192]
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210])
    halves = []
    for half in range(2):  # each half: 64 bytes of ql, 32 of qh -> 128 values
        low, high = ql[..., 64 * half : 64 * half + 64], qh[..., 32 * half : 32 * half + 32]
        parts = [(low[..., 0:32] & 15), (low[..., 32:64] & 15), (low[..., 0:32] >> 4), (low[..., 32:64] >> 4)]
        halves += [p | (((high >> (2 * i)) & 3) << 4) for i, p in enumerate(parts)]
    q = np.concatenate(halves, axis=-1)
    scale = d[..., None] * sc
    return _finish(q, scale, -32 * scale, 16, 6)


READERS = {
    T.Q4_0: q4_0,
    T.Q4_1: q4_1,
    T.Q5_0: q5_0,
    T.Q5_1: q5_1,
    T.Q8_0: q8_0,
    T.Q4_K: q4_k,
    T.Q5_K: q5_k,
    T.Q6_K: q6_k,
}
FLOAT_TYPES = (T.F32, T.F16, T.BF16)


def to_affine(raw: torch.Tensor, qtype: T) -> AffineWeight:
    if qtype not in READERS:
        raise ValueError(
            f"GGUF type {qtype.name} is not supported (supported: "
            f"{', '.join(t.name for t in READERS)}, and float types)"
        )
    return READERS[qtype](raw)


@attrs.frozen
class GGUFBlocks:
    """A quantized tensor as the file stores it, yielded by the loader with ``keep_quantized``."""

    raw: torch.Tensor  # uint8 [rows, bytes per row]
    qtype: T

    @property
    def shape(self) -> tuple[int, int]:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return self.raw.shape[0], self.raw.shape[1] // size * block

    def affine(self) -> AffineWeight:
        return to_affine(self.raw, self.qtype)
