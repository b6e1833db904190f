"""Helpers for drafters that run a model (public API for spec plugins): run any engine
:class:`~engine.interfaces.Model` over ragged token chunks through the paged KV cache,
with the target's block tables."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from engine.interfaces import StepContext
from engine.runner.batch import token_layout


@attrs.frozen
class Chunk:
    token_ids: Sequence[int]  # tokens to run
    start: int  # position of the first one
    block_ids: Sequence[int]  # the sequence's block table


@torch.inference_mode()
def run_chunks(
    model,
    attention,
    kv_caches: list[torch.Tensor],
    chunks: Sequence[Chunk],
    block_size: int,
    device,
    **forward_kwargs,
) -> tuple[torch.Tensor, list[int]]:
    """Forward every chunk in one batch, writing their K/V; -> (hidden states of all rows,
    the row of each chunk's last token)."""
    lens = [len(c.token_ids) for c in chunks]
    positions, layout = token_layout(
        lens,
        [c.start + n for c, n in zip(chunks, lens)],
        [list(c.block_ids) for c in chunks],
        block_size,
        device,
    )
    ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long, device=device)
    step = StepContext(attention, attention.build_metadata(layout), kv_caches)
    hidden = model(ids, positions, step, **forward_kwargs)
    last = [int(v) - 1 for v in torch.tensor(lens).cumsum(0)]
    return hidden, last
