"""The platform's layer-op kernels (``kernels.c``, declared in ``kernels.h``), built once per
machine by :mod:`engine.native` and loaded once per process."""

from __future__ import annotations

import functools
from pathlib import Path

from engine.native import Library, load_source

SOURCE = Path(__file__).with_name("kernels.c")


@functools.cache
def library() -> Library:
    """The kernels, built with ``$CC`` (default ``cc``); raises
    :class:`engine.native.BuildError` saying why they cannot be built."""
    return load_source(SOURCE)
