"""One block of memory for the activations of an engine's native tapes, planned by liveness.

A recorded forward allocates a fresh tensor for every activation of every layer (0.42 MiB a row
on the default model), and its tape keeps them all alive: the memory grows with the batch, and
a replay writes each layer's outputs to memory no cache holds, where the eager forward reuses
the blocks the allocator just freed. Laying them out again fixes both. An activation lives from
the first to the last kernel call that addresses it (the tape is the whole program: nothing
else reads it), so two activations whose lives do not overlap may share bytes; and only one
tape replays at a time, so every tape of an engine lays its activations in the same block.

:func:`plan` places one tape's activations (largest first, each at the lowest offset free for
its whole life); :class:`Arena` is the shared block, grown to the largest plan, whose
``generation`` tells a tape when the block has moved and its kernels' pointers must follow.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import attrs
import torch

ALIGN = 64  # bytes: a cache line, the alignment torch's CPU allocator gives


@attrs.frozen
class Layout:
    """Where one tape's activations go: ``nbytes`` of arena; each kernel argument that pointed
    into one of them as (op, integer slot, offset into the arena); and each storage's offset by
    its old address."""

    nbytes: int
    moves: tuple[tuple[int, int, int], ...]
    offsets: dict[int, int]


def plan(
    pointers: Sequence[Sequence[tuple[int, int]]],
    storages: Sequence[tuple[int, int]],
    output: int | None = None,
) -> Layout:
    """The layout of ``storages`` ((address, bytes) each, disjoint) for a tape whose op ``i``
    passes the pointer arguments ``pointers[i]`` ((integer slot, address) each); the storage at
    address ``output`` (what the forward returns) lives to the tape's end, for the caller to read.
    An address in no storage is left where it points; a storage no argument addresses gets no
    room."""
    storages = sorted((start, size) for start, size in storages if size > 0)
    starts = [start for start, _ in storages]
    lives: dict[int, list[int]] = {}
    uses = []
    for op, arguments in enumerate(pointers):
        for slot, address in arguments:
            index = bisect.bisect_right(starts, address) - 1
            if index < 0 or address >= starts[index] + storages[index][1]:
                continue
            life = lives.setdefault(index, [op, op])
            life[1] = op
            uses.append((op, slot, index, address - starts[index]))
    for index, life in lives.items():
        if starts[index] == output:
            life[1] = len(pointers)
    offsets, nbytes = _place({index: (storages[index][1], *life) for index, life in lives.items()})
    return Layout(
        nbytes,
        tuple((op, slot, offsets[index] + delta) for op, slot, index, delta in uses),
        {starts[index]: offset for index, offset in offsets.items()},
    )


def _place(blocks: dict[int, tuple[int, int, int]]) -> tuple[dict[int, int], int]:
    """Offsets for blocks (bytes, first op, last op) so that two whose lives overlap never share
    a byte: largest first, each at the lowest aligned offset clear of those already placed that
    live at the same time. Returns (offset by block, bytes in all)."""
    placed: list[tuple[int, int, int, int]] = []  # (offset, end, first, last)
    offsets, top = {}, 0
    for index, (size, first, last) in sorted(blocks.items(), key=lambda item: (-item[1][0], item[1][1])):
        size = -(-size // ALIGN) * ALIGN
        offset = 0
        for start, end, _, _ in sorted(p for p in placed if p[2] <= last and first <= p[3]):
            if offset + size <= start:
                break
            offset = max(offset, end)
        placed.append((offset, offset + size, first, last))
        offsets[index], top = offset, max(top, offset + size)
    return offsets, top


class Arena:
    """The block every tape of one engine lays its activations in (one tape replays at a time)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self._buffer = torch.empty(0, dtype=torch.uint8, device=device)
        self.generation = 0  # bumped whenever the block moves

    @property
    def nbytes(self) -> int:
        return self._buffer.numel()

    @property
    def base(self) -> int:
        return self._buffer.data_ptr()

    @property
    def storage(self) -> torch.UntypedStorage:
        return self._buffer.untyped_storage()

    def reserve(self, nbytes: int) -> None:
        """Make the block at least ``nbytes`` long (a new block: the tapes re-point at it)."""
        if nbytes > self._buffer.numel():
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self._buffer.device)
            self.generation += 1
