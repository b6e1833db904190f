"""One GGUF tensor read lazily, so a tensor-parallel rank copies only its part out of the file.

Coordinates are the Hugging Face weight's, [rows, columns] (GGUF lists dims the other way
round). A row range reads those rows' bytes; a column range reads, on every row, the blocks
that hold those columns — whole blocks (32 or 256 values, one for float types). Kept
quantized, a column range must fall on block boundaries (a block's scale covers all of it);
dequantized, the enclosing blocks are read and the columns cut out after dequantizing.
llama.cpp's q/k row permutation is undone on the rows read, head by head (so a row range
must hold whole heads), as ``transformers``' llama processor does on the whole tensor.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES

from engine.layers.checkpoint import CheckpointSlice
from engine_quant_gguf.formats import FLOAT_TYPES, READERS, GGUFBlocks


class GGUFSlice(CheckpointSlice):
    """``tensor``: a ``gguf`` ``ReaderTensor`` (its ``data`` a view of the memory-mapped file);
    ``loader``: whose ``bytes_read`` counts the bytes copied; ``keep_quantized``: quantized
    parts come as :class:`GGUFBlocks`, else float32; ``heads``: the heads of llama.cpp's q/k
    row permutation (None: no permutation)."""

    def __init__(self, tensor, loader, keep_quantized: bool, heads: int | None):
        self.tensor, self.loader, self.heads = tensor, loader, heads
        self.keep = keep_quantized and tensor.tensor_type not in FLOAT_TYPES and tensor.tensor_type in READERS

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self.tensor.shape))

    def full(self):
        return self.narrow(0, 0, self.shape[0])

    def narrow(self, dim: int, start: int, length: int):
        if dim == 0:
            data = self.tensor.data[start : start + length]
            return self._finish(data, start, length, 0, self.shape[-1])
        if dim != 1 or len(self.shape) != 2:
            raise ValueError(f"GGUF tensor {self.tensor.name}: no slices along dim {dim} of {self.shape}")
        block, units = self._block()
        first, end = start // block * block, -(-(start + length) // block) * block
        if self.keep and (first, end) != (start, start + length):
            raise ValueError(
                f"GGUF tensor {self.tensor.name} ({self.tensor.tensor_type.name}, {block}-value blocks): "
                f"columns [{start}, {start + length}) of {self.shape[1]} do not fall on block boundaries, "
                "so a tensor-parallel rank cannot keep its part quantized; choose a tensor_parallel_size "
                f"that splits this layer on {block}-value boundaries, or dequantize at load "
                "(--quantization unquantized)"
            )
        data = self.tensor.data[:, first // block * units : end // block * units]
        return self._finish(data, 0, self.shape[0], start - first, length)

    def _block(self) -> tuple[int, int]:
        """(values per block, stored units per block along a row of ``tensor.data``)."""
        values, _ = GGML_QUANT_SIZES[self.tensor.tensor_type]
        return values, self.tensor.data.shape[-1] * values // self.shape[-1]

    def _finish(self, data: np.ndarray, row: int, rows: int, column: int, columns: int):
        """The part read (rows [row, row + rows) of the tensor; ``data``'s columns from
        ``column`` on, ``columns`` of them, are wanted) as this slice yields it."""
        from gguf.quants import dequantize

        data = np.array(data)  # the copy out of the memory map: the bytes read
        self.loader.bytes_read += data.nbytes
        if self.keep:
            return GGUFBlocks(torch.from_numpy(self._unpermute(data, row, rows)), self.tensor.tensor_type)
        values = dequantize(data, self.tensor.tensor_type)
        if values.ndim == 2:
            values = values[:, column : column + columns]
        return torch.from_numpy(np.require(self._unpermute(values, row, rows), requirements=["C", "W"]))

    def _unpermute(self, rows_data: np.ndarray, row: int, rows: int) -> np.ndarray:
        """llama.cpp's interleaved rope rows back in Hugging Face order, head by head."""
        if self.heads is None:
            return rows_data
        head_rows = self.shape[0] // self.heads
        if row % head_rows or rows % head_rows:
            raise ValueError(
                f"GGUF tensor {self.tensor.name}: rows [{row}, {row + rows}) split a head of {head_rows} rows"
            )
        split = rows_data.reshape(rows // head_rows, head_rows // 2, 2, *rows_data.shape[1:])
        return split.swapaxes(1, 2).reshape(rows_data.shape)
