"""The worker half's store: a CPU-memory tier (one slab of block slots allocated up front, pinned
when the device is CUDA) and an optional disk tier under it (one file per block). A block saved
when the CPU tier is full pushes the CPU tier's least recently used block down to disk (or drops
it without a disk tier: a later load of it fails and is recomputed). Which blocks exist is the
scheduler half's decision (it orders evictions); this store only places them."""

from __future__ import annotations

import os
from collections import OrderedDict

import torch


class BlockStore:
    def __init__(
        self,
        num_cpu_blocks: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        disk_path: str | None,
        pin: bool,
    ):
        self.slab = torch.empty((num_cpu_blocks, *block_shape), dtype=dtype, pin_memory=pin)
        self.block_shape, self.dtype = tuple(block_shape), dtype
        self.nbytes = self.slab[0].nbytes if num_cpu_blocks else 0
        self.cpu: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self.free_slots = list(range(num_cpu_blocks - 1, -1, -1))
        self.disk_path = disk_path
        self.on_disk: set[bytes] = set()
        if disk_path:
            os.makedirs(disk_path, exist_ok=True)

    def __contains__(self, key: bytes) -> bool:
        return key in self.cpu or key in self.on_disk

    def slot_for(self, key: bytes, before_spill) -> int | None:
        """A CPU slot to save ``key`` into (the LRU block goes down to disk, or is dropped, when
        the tier is full; ``before_spill`` runs first so pending copies into it have landed)."""
        if key in self.cpu:
            self.cpu.move_to_end(key)
            return self.cpu[key]
        if not self.free_slots:
            if not self.cpu:
                return None
            old, slot = self.cpu.popitem(last=False)
            before_spill()
            if self.disk_path:
                self.slab[slot].view(torch.uint8).numpy().tofile(self._file(old))
                self.on_disk.add(old)
            self.free_slots.append(slot)
        slot = self.free_slots.pop()
        self.cpu[key] = slot
        self.on_disk.discard(key)
        return slot

    def source(self, key: bytes) -> torch.Tensor | None:
        """The block's host tensor [layers, ...]: a CPU slot (marked recently used) or read from
        its file; None when it is missing or the file is damaged (a failed load)."""
        slot = self.cpu.get(key)
        if slot is not None:
            self.cpu.move_to_end(key)
            return self.slab[slot]
        if key not in self.on_disk:
            return None
        path = self._file(key)
        try:
            if os.path.getsize(path) != self.nbytes:
                return None
            raw = torch.from_file(path, size=self.nbytes, dtype=torch.uint8)
        except (OSError, RuntimeError):
            return None
        return raw.view(self.dtype).view(self.block_shape)

    def evict(self, key: bytes) -> None:
        slot = self.cpu.pop(key, None)
        if slot is not None:
            self.free_slots.append(slot)
        if key in self.on_disk:
            self.on_disk.discard(key)
            try:
                os.remove(self._file(key))
            except FileNotFoundError:
                pass

    def _file(self, key: bytes) -> str:
        return os.path.join(self.disk_path, key.hex() + ".kv")
