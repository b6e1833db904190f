"""A CPU storage's pages, through ``madvise``.

:func:`release` gives a storage's memory back to the system while keeping its address, as vLLM's
CuMem allocator does on CUDA: ``MADV_DONTNEED`` drops the physical pages of the whole pages
inside the storage, the mapping stays, and the next touch reads zeros. Whatever recorded the
address (a native tape, a KV connector) stays valid; the owner refills the contents before use.

:func:`onto_huge_pages` moves storages onto 2 MiB pages in place (``MADV_HUGEPAGE``, then Linux
6.1's ``MADV_COLLAPSE``): the same addresses, the same bytes, a TLB entry and an unbroken run for
the hardware prefetchers per 2 MiB instead of per 4 KiB.

Only anonymous memory is touched: a page of a file mapping (weights read in place from a
checkpoint) is left alone, since writing it back later could fault."""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

MADV_DONTNEED, MADV_HUGEPAGE, MADV_COLLAPSE = 4, 14, 25  # linux/mman.h
HUGE_PAGE = 2 << 20

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def release(storages: list[torch.UntypedStorage]) -> int:
    """Release the whole pages inside each storage's bytes; returns the bytes released."""
    files = _file_mappings()
    released = 0
    for storage in storages:
        start, end = _whole_pages(storage)
        if end <= start or _in_a_file(start, end, files):
            continue
        if _libc.madvise(start, end - start, MADV_DONTNEED) != 0:
            raise OSError(ctypes.get_errno(), f"madvise: {os.strerror(ctypes.get_errno())}")
        released += end - start
    return released


def onto_huge_pages(storages: list[torch.UntypedStorage]) -> tuple[int, int]:
    """Advise and collapse every 2 MiB page that holds part of ``storages`` (anonymous memory
    only); returns (bytes collapsed now, bytes advised). Where the kernel cannot collapse in
    place (before Linux 6.1, or no huge page free) the advice stays and ``khugepaged`` may
    collapse the pages later. A page may also hold other allocations: they move with it."""
    files = _file_mappings()
    pages: set[int] = set()
    for storage in storages:
        start = storage.data_ptr()
        end = start + storage.nbytes()
        if storage.nbytes() and not _in_a_file(start, end, files):
            pages.update(range(start // HUGE_PAGE, -(-end // HUGE_PAGE)))
    collapsed = advised = 0
    for page in sorted(pages):
        address = page * HUGE_PAGE
        if _libc.madvise(address, HUGE_PAGE, MADV_HUGEPAGE) != 0:
            continue  # not one anonymous mapping (a page shared with a file or a guard page)
        advised += HUGE_PAGE
        collapsed += HUGE_PAGE if _libc.madvise(address, HUGE_PAGE, MADV_COLLAPSE) == 0 else 0
    return collapsed, advised


def _whole_pages(storage: torch.UntypedStorage) -> tuple[int, int]:
    """The page-aligned range inside ``storage``'s bytes (it may share its edge pages)."""
    start = storage.data_ptr()
    end = start + storage.nbytes()
    page = mmap.PAGESIZE
    return -(-start // page) * page, end // page * page


def _in_a_file(start: int, end: int, files: list[tuple[int, int]]) -> bool:
    """Whether [start, end) overlaps one of ``files`` (:func:`_file_mappings`)."""
    return any(lo < end and start < hi for lo, hi in files)


def _file_mappings() -> list[tuple[int, int]]:
    """Address ranges of this process that map a file (``/proc/self/maps`` lines with an inode)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[4] != "0":
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((lo, hi))
    return ranges
