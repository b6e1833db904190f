"""Helpers for drafters that run a model (public API for spec plugins): run any engine
:class:`~engine.interfaces.Model` over ragged token chunks through the paged KV cache,
with the target's block tables, and chain greedy drafts from the target's hidden states."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from engine.interfaces import Draft, DraftRequest, StepContext
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


# (the live requests' chunks, their hidden states, the depth) -> (the pass's hidden states
# [rows, hidden], each chunk's last row in them, each chunk's greedy draft token)
DraftStep = Callable[[list[Chunk], list[torch.Tensor], int], tuple[torch.Tensor, list[int], list[int]]]


def chain_drafts(requests: Sequence[DraftRequest], step: DraftStep) -> list[Draft]:
    """Greedy drafts chained from the target's hidden states (EAGLE's head, DeepSeek's MTP
    module): a request with hidden states first runs the tokens they belong to, one row each,
    then its own last draft, fed the hidden state its previous pass gave that row, until its
    ``max_tokens``; a request without hidden states gets an empty draft."""
    ready = [i for i, r in enumerate(requests) if r.hidden_states is not None and len(r.hidden_states)]
    drafts: list[list[int]] = [[] for _ in requests]
    chunks, states = {}, {}
    for i in ready:
        r = requests[i]
        n, count = len(r.token_ids), len(r.hidden_states)
        chunks[i] = Chunk(list(r.token_ids[n - count :]), n - 1 - count, r.block_ids)
        states[i] = r.hidden_states
    live = ready
    for depth in range(max((requests[i].max_tokens for i in ready), default=0)):
        hidden, rows, tokens = step([chunks[i] for i in live], [states[i] for i in live], depth)
        next_live = []
        for row, i, token in zip(rows, live, tokens):
            drafts[i].append(token)
            r = requests[i]
            if depth + 1 < r.max_tokens:
                chunks[i] = Chunk([token], len(r.token_ids) - 1 + depth, r.block_ids)
                states[i] = hidden[row : row + 1]
                next_live.append(i)
        live = next_live
        if not live:
            break
    return [Draft(d) for d in drafts]
