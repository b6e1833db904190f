"""glibc's heap for a process whose steps allocate and free the same big tensors.

torch takes CPU tensors from malloc, and glibc serves a block above its mmap threshold with a
fresh mapping that it unmaps on free. The threshold rises by itself to the largest such block
freed, but never past 32 MiB, and the logits of a decode step of 256 requests over a 49 152-token
vocabulary are 50 MB of float32: mapped, faulted in and zeroed page by page (~14 700 minor faults
a step) and unmapped again at every step, ~10 % of the step on the default model
(docs/decisions.md). :func:`keep_freed_blocks` raises the mmap threshold, and the trim threshold
with it (else freeing the top of the heap hands those pages back all the same), so such blocks
are reused from the heap with their pages resident, as with the tcmalloc that vLLM's CPU build
recommends preloading. The heap then keeps what a step freed (+78 MB resident at 256 rows);
:func:`give_back` returns its free pages (``malloc_trim``) where memory is counted (the KV cache
is sized from what is available) or released (sleep mode).
"""

from __future__ import annotations

import ctypes
import functools
import os

__all__ = ["THRESHOLD", "USER_SETTINGS", "give_back", "keep_freed_blocks"]

THRESHOLD = 1 << 30  # blocks up to this size come from the heap, and its top is kept up to it
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")  # glibc's own variables, kept


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The process's C library where it is glibc (mallopt and malloc_trim), else None."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if not all(hasattr(libc, name) for name in ("mallopt", "malloc_trim", "gnu_get_libc_version")):
        return None
    return libc


def keep_freed_blocks() -> str:
    """Raise glibc's mmap and trim thresholds to :data:`THRESHOLD`, unless the environment sets
    either; returns what the heap does, in words, for the start-up log."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    given = [name for name in USER_SETTINGS if name in os.environ]
    given += [f"GLIBC_TUNABLES={tunables}"] if "threshold" in tunables else []
    if given:
        return f"glibc's thresholds from the environment ({', '.join(given)})"
    libc = _glibc()
    if libc is None:
        return "the C library's default (not glibc)"
    if not (libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, THRESHOLD)):
        return "glibc's default (mallopt refused the thresholds)"
    return f"freed blocks up to {THRESHOLD >> 20} MiB kept for reuse"


def give_back() -> None:
    """Return the heap's free pages to the system (glibc's ``malloc_trim``; nothing elsewhere)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
