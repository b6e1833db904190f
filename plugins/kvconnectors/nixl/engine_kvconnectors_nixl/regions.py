"""Regions: where an instance's KV blocks lie in memory, as NIXL descriptors.

A layer's cache is one contiguous tensor whose dimension ``block_dim`` indexes blocks; the
dimensions before it make ``chunks`` runs per block (the torch backend's ``[2, kv_heads, blocks,
block_size, head_dim]`` has 2 * kv_heads runs of ``block_size * head_dim`` elements). Run ``c`` of
block ``b`` of layer ``l`` is one descriptor, at ``bases[l] + (c * num_blocks + b) * chunk_bytes``,
index ``(l * chunks + c) * num_blocks + b`` in the list :meth:`Regions.descriptors` prepares once.
Both instances list a transfer's descriptors in the same order (layer, run, then the blocks in
the order given), so pairing local index i with remote index i moves block i into block i.
"""

from __future__ import annotations

import math

import attrs
import numpy as np
import torch


@attrs.frozen
class Regions:
    bases: tuple[int, ...]  # each layer's cache address
    num_blocks: int
    chunks: int  # runs per block per layer
    chunk_bytes: int
    mem_type: str = "DRAM"  # NIXL's name: "DRAM" (host) or "VRAM" (a GPU's)
    device: int = 0

    @classmethod
    def of(cls, caches: list[torch.Tensor], block_dim: int) -> Regions:
        """ValueError when the caches are not equal contiguous tensors (NIXL reads raw memory)."""
        if not caches:
            raise ValueError("no KV cache tensors to register")
        first = caches[0]
        for layer, cache in enumerate(caches):
            if not cache.is_contiguous():
                raise ValueError(f"the KV cache of layer {layer} is not contiguous")
            if (cache.shape, cache.dtype, cache.device) != (first.shape, first.dtype, first.device):
                raise ValueError(
                    f"the KV cache of layer {layer} is {tuple(cache.shape)} {cache.dtype} on "
                    f"{cache.device}, layer 0's {tuple(first.shape)} {first.dtype} on {first.device}"
                )
        shape = tuple(first.shape)
        if len(caches) * math.prod(shape[: block_dim + 1]) >= 2**31:
            raise ValueError("over 2**31 block runs: NIXL's descriptor indices are 32-bit")
        on_gpu = first.device.type != "cpu"
        return cls(
            tuple(cache.data_ptr() for cache in caches),
            shape[block_dim],
            math.prod(shape[:block_dim]),
            math.prod(shape[block_dim + 1 :]) * first.element_size(),
            "VRAM" if on_gpu else "DRAM",
            (first.device.index or 0) if on_gpu else 0,
        )

    @property
    def num_layers(self) -> int:
        return len(self.bases)

    @property
    def block_bytes(self) -> int:
        """One block across every layer."""
        return self.num_layers * self.chunks * self.chunk_bytes

    def descriptors(self) -> np.ndarray:
        """Every run of every block: an [N, 3] array of (address, bytes, device)."""
        offsets = np.arange(self.chunks * self.num_blocks, dtype=np.uint64) * np.uint64(self.chunk_bytes)
        addresses = (np.array(self.bases, dtype=np.uint64)[:, None] + offsets[None, :]).ravel()
        table = np.empty((addresses.size, 3), dtype=np.uint64)
        table[:, 0], table[:, 1], table[:, 2] = addresses, self.chunk_bytes, self.device
        return table

    def indices(self, block_ids) -> np.ndarray:
        """The descriptor indices of these blocks, in the order both sides use."""
        blocks = np.asarray(block_ids, dtype=np.int64)
        if blocks.size and (blocks.min() < 0 or blocks.max() >= self.num_blocks):
            raise ValueError(f"block ids outside 0..{self.num_blocks - 1}: {list(block_ids)}")
        runs = np.arange(self.num_layers * self.chunks, dtype=np.int64)[:, None] * self.num_blocks
        return (runs + blocks[None, :]).ravel().astype(np.int32)

    def peer(self, info: dict) -> Regions:
        """A peer's regions from its hello (equal layouts: the same runs per block)."""
        try:
            bases = tuple(int(base) for base in info["bases"])
            if len(bases) != self.num_layers:
                raise ValueError(f"{len(bases)} layers, {self.num_layers} here")
            return attrs.evolve(
                self,
                bases=bases,
                num_blocks=int(info["num_blocks"]),
                mem_type=str(info["mem_type"]),
                device=int(info["device"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a description of KV cache memory: {exc}") from exc

    def describe(self) -> dict:
        """What a peer needs to build :meth:`peer` (sent in the hello)."""
        return {
            "bases": list(self.bases),
            "num_blocks": self.num_blocks,
            "mem_type": self.mem_type,
            "device": self.device,
        }
