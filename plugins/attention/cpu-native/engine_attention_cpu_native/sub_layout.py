"""Some of a step's requests as a step of their own, for the rows a C backend hands to the torch
reference (long prefill chunks for cpu-native, everything but absorbed decodes for MLA)."""

from __future__ import annotations

import attrs
import torch

from engine.interfaces import AttentionBackend, BatchLayout


@attrs.frozen
class Delegated:
    """Rows the reference backend attends as a batch of their own, with its metadata for them."""

    rows: torch.Tensor | slice  # rows of the flattened batch (a slice where they are contiguous)
    metadata: object


def delegate(
    layout: BatchLayout, requests: list[int], starts: list[int], reference: AttentionBackend
) -> Delegated:
    """``requests`` of ``layout`` as ``reference``'s own step; ``starts`` is
    ``layout.query_start_loc`` as a list."""
    rows, sub = requests_layout(layout, requests, starts)
    first, last = int(rows[0]), int(rows[-1]) + 1
    contiguous = last - first == len(rows)
    return Delegated(slice(first, last) if contiguous else rows, reference.build_metadata(sub))


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
