"""The platform's layer-op kernels (``kernels.c``, declared in ``kernels.h``), built once per
machine by :mod:`engine.native` and loaded once per process."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from engine.native import Library, load_source

SOURCE = Path(__file__).with_name("kernels.c")
# "0" keeps every matmul off the AMX tiles (affine.py, dense.py), on the kernels whose rows are
# the same bits in any batch and on any machine kind
TILES_VARIABLE = "ENGINE_CPU_AMX_TILES"


@functools.cache
def library() -> Library:
    """The kernels, built with ``$CC`` (default ``cc``); raises
    :class:`engine.native.BuildError` saying why they cannot be built."""
    return load_source(SOURCE)


def activation_rows(x: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the matmul kernels read activations: [rows, width] in ``dtype``, each row's
    values adjacent (rows may be strided, as a view of a wider output)."""
    if x.dim() != 2:
        x = x.reshape(-1, width)
    if x.dtype != dtype:
        x = x.to(dtype)
    return x if x.stride(-1) == 1 else x.contiguous()


def tiles_allowed() -> bool:
    """Whether ``ENGINE_CPU_AMX_TILES`` lets matmuls take the AMX tiles (it is not ``0``)."""
    return os.environ.get(TILES_VARIABLE, "1") != "0"
