"""The encoder cache: a multimodal model's encoder output per image, by ``mm_hash``.

An image's encoder runs once, for the whole image, the first time a step reaches any of its
placeholder rows; each step then takes the slice of rows it computes. So a prefill chunked
through an image span feeds the model exactly the rows an unchunked one would, and a later
request with the same image (or this one recomputed after preemption) runs no encoder at all
while the output stays cached. Bounded in bytes (``mm_encoder_cache_bytes``), least recently
used evicted first; one larger than the whole cache is used for its step and not kept."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from engine.messages.multimodal import MultiModalItem
from engine.messages.step import ScheduledRequest

Encode = Callable[[MultiModalItem], torch.Tensor]


class EncoderCache:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.used_bytes = 0
        self.encoder_runs = 0  # images encoded (cache misses)
        self.hits = 0

    def embeddings(self, item: MultiModalItem, encode: Encode) -> torch.Tensor:
        """``item``'s encoder output [length, hidden]: cached, else encoded now and kept."""
        cached = self._entries.get(item.mm_hash)
        if cached is not None:
            self._entries.move_to_end(item.mm_hash)
            self.hits += 1
            return cached
        embeds = encode(item)
        self.encoder_runs += 1
        if embeds.shape[0] != item.length:
            raise ValueError(
                f"the model's encoder returned {embeds.shape[0]} rows for an image of {item.length} "
                "placeholder tokens (its processor and encoder disagree)"
            )
        self._keep(item.mm_hash, embeds)
        return embeds

    def _keep(self, mm_hash: str, embeds: torch.Tensor) -> None:
        size = embeds.numel() * embeds.element_size()
        if size > self.capacity_bytes:
            return
        while self.used_bytes + size > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.used_bytes -= evicted.numel() * evicted.element_size()
        self._entries[mm_hash] = embeds
        self.used_bytes += size

    def __len__(self) -> int:
        return len(self._entries)


def step_embeddings(
    scheduled: Sequence[ScheduledRequest],
    row_offsets: Sequence[int],
    cache: EncoderCache,
    encode: Encode,
    device,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(flattened rows [N], their embeddings [N, hidden]) of every image row this step computes:
    request ``i``'s tokens start at row ``row_offsets[i]``; (None, None) when no row is an image's."""
    rows: list[int] = []
    pieces = []
    for item, row_offset in zip(scheduled, row_offsets):
        request = item.request
        start = request.num_computed_tokens
        end = start + item.num_new_tokens
        for mm in request.mm_items:
            first, last = max(start, mm.offset), min(end, mm.end)
            if first >= last:
                continue
            pieces.append(cache.embeddings(mm, encode)[first - mm.offset : last - mm.offset])
            rows += range(row_offset + first - start, row_offset + last - start)
    if not rows:
        return None, None
    return torch.tensor(rows, dtype=torch.long, device=device), torch.cat(pieces)
