"""BlockLayout: what one KV block is on an instance. Two instances exchange blocks only when
their layouts are equal (same model, attention backend layout, dtype and block size): a transport
compares the peer's layout with its own before its first transfer and fails the transfer
(the request recomputes) naming every difference."""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class BlockLayout:
    block_size: int  # tokens per block
    num_layers: int  # KV cache tensors
    block_shape: tuple[int, ...]  # one layer's block: cache.select(block_dim, 0).shape
    dtype: str  # e.g. "float32"
    block_dim: int  # the cache dimension that indexes blocks

    @classmethod
    def of(cls, caches: list[torch.Tensor], block_dim: int, block_size: int) -> BlockLayout:
        block = caches[0].select(block_dim, 0)
        return cls(
            block_size, len(caches), tuple(block.shape), str(block.dtype).removeprefix("torch."), block_dim
        )

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block in one layer."""
        count = 1
        for size in self.block_shape:
            count *= size
        return count * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def mismatch(self, other: BlockLayout) -> list[str]:
        """Every field that differs, as ``name: ours vs theirs``."""
        return [
            f"{field.name}: {getattr(self, field.name)!r} here vs {getattr(other, field.name)!r} there"
            for field in attrs.fields(BlockLayout)
            if getattr(self, field.name) != getattr(other, field.name)
        ]

    def to_dict(self) -> dict:
        return {**attrs.asdict(self), "block_shape": list(self.block_shape)}

    @classmethod
    def from_dict(cls, data: dict) -> BlockLayout:
        """ValueError when ``data`` is not a layout (a peer of another version)."""
        try:
            return cls(
                int(data["block_size"]),
                int(data["num_layers"]),
                tuple(int(s) for s in data["block_shape"]),
                str(data["dtype"]),
                int(data["block_dim"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a block layout: {data!r}") from exc
