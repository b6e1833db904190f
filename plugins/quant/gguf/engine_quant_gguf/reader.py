"""A GGUF file's metadata and tensors, read in milliseconds.

``gguf``'s own ``GGUFReader`` builds a numpy view for every element of every metadata array
(a 49k-token vocabulary and its merges: ~150k views, seconds of each start-up). The loader
needs from the metadata only scalars and strings (the architecture, sampling defaults, the
alignment) and whether an array is there, so this reader steps over arrays without building
them (string arrays by their length prefixes) and gives the tensors as ``GGUFReader`` does:
the same names, types and byte counts, and the same numpy views of the memory-mapped file
(quantized types as uint8 ``[..., bytes per row]``, float and integer types as their own
dtype, dimensions in numpy order)."""

from __future__ import annotations

import struct

import attrs
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.constants import GGUF_DEFAULT_ALIGNMENT

V = GGUFValueType
SCALARS = {
    V.UINT8: "<B",
    V.INT8: "<b",
    V.UINT16: "<H",
    V.INT16: "<h",
    V.UINT32: "<I",
    V.INT32: "<i",
    V.FLOAT32: "<f",
    V.BOOL: "<?",
    V.UINT64: "<Q",
    V.INT64: "<q",
    V.FLOAT64: "<d",
}
T = GGMLQuantizationType
ELEMENT_TYPES = {
    T.F16: np.float16,
    T.F32: np.float32,
    T.F64: np.float64,
    T.I8: np.int8,
    T.I16: np.int16,
    T.I32: np.int32,
    T.I64: np.int64,
}


@attrs.frozen
class Array:
    """A metadata array, not read: its element type and length."""

    item_type: GGUFValueType
    count: int


@attrs.frozen
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml's order, innermost first
    n_elements: int
    n_bytes: int
    data: np.ndarray


class GGUFFile:
    def __init__(self, path: str):
        self.data = np.memmap(path, dtype=np.uint8, mode="r")
        if bytes(self.data[:4]) != b"GGUF":
            raise ValueError(f"{path!r} has no GGUF magic")
        self._offset = 4
        version, tensor_count, field_count = self._unpack("<I"), self._unpack("<Q"), self._unpack("<Q")
        if version not in (2, 3):
            raise ValueError(f"{path!r}: GGUF version {version} is not supported (2 or 3)")
        self.fields: dict[str, object] = {}
        for _ in range(field_count):
            key = self._string()
            self.fields[key] = self._value(V(self._unpack("<I")))
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = int(self.fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _unpack(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.data, self._offset)
        self._offset += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._unpack("<Q")
        text = bytes(self.data[self._offset : self._offset + length]).decode("utf-8")
        self._offset += length
        return text

    def _value(self, kind: GGUFValueType):
        if kind == V.STRING:
            return self._string()
        if kind in SCALARS:
            return self._unpack(SCALARS[kind])
        if kind != V.ARRAY:
            raise ValueError(f"GGUF metadata type {kind} is unknown")
        item_type, count = V(self._unpack("<I")), self._unpack("<Q")
        if item_type == V.STRING:
            for _ in range(count):
                length = self._unpack("<Q")  # (not ``offset += unpack()``: that reads the offset first)
                self._offset += length
        elif item_type in SCALARS:
            self._offset += count * struct.calcsize(SCALARS[item_type])
        else:
            for _ in range(count):  # arrays of arrays: rare, walked one by one
                self._value(item_type)
        return Array(item_type, count)

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
        return name, dims, T(self._unpack("<I")), self._unpack("<Q")

    def _tensor(self, start: int, name: str, dims, kind: GGMLQuantizationType, offset: int) -> Tensor:
        elements = int(np.prod(dims))
        block, size = GGML_QUANT_SIZES[kind]
        n_bytes = elements * size // block
        shape = tuple(reversed(dims))
        raw = self.data[start + offset : start + offset + n_bytes]
        if kind in ELEMENT_TYPES:
            data = raw.view(ELEMENT_TYPES[kind]).reshape(shape)
        else:  # blocks: bytes per row on the last axis
            data = raw.reshape(*shape[:-1], shape[-1] // block * size)
        return Tensor(name, kind, dims, elements, n_bytes, data)
