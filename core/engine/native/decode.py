"""A decode step's inputs moved on by the tokens it chose, in C (``decode.c``), bound for native
tapes: the greedy decode step's recording ends with it (:mod:`engine.runner.step_graphs`), so a
burst of steps replays with no Python between them. None where the library cannot be built here
(no C compiler): the runner then moves them with torch ops, which a tape cannot record."""

from __future__ import annotations

import functools
from pathlib import Path

from engine.native.tape import NativeKernel, bind_source

SOURCE = Path(__file__).with_name("decode.c")


@functools.cache
def advance_kernel() -> NativeKernel | None:
    """``decode_advance`` bound, or None where it cannot be built."""
    return bind_source(SOURCE, "decode_advance", "decode inputs advance through torch ops")
