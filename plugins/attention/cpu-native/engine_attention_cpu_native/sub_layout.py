"""Some of a step's requests as a step of their own, for the rows a C backend hands to the torch
reference (prefills and long queries here, MLA's naive path)."""

from __future__ import annotations

import torch

from engine.interfaces import BatchLayout


def requests_layout(
    layout: BatchLayout, requests: list[int], starts: list[int]
) -> tuple[torch.Tensor, BatchLayout]:
    """(the query rows of ``requests`` in ``layout``, a layout of those requests alone);
    ``starts`` is ``layout.query_start_loc`` as a list."""
    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in requests])
    lens = [layout.query_lens[i] for i in requests]
    index = torch.tensor(requests)
    sub = BatchLayout(
        query_start_loc=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=layout.seq_lens[index],
        block_table=layout.block_table[index],
        slot_mapping=layout.slot_mapping[rows],
        query_lens=tuple(lens),
        seq_lens_host=tuple(layout.seq_lens_host[i] for i in requests),
    )
    return rows, sub
