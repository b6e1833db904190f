"""Flatten one step's plan into the token axis the model and attention backend consume."""

from __future__ import annotations

import attrs
import numpy as np
import torch

from engine.interfaces import BatchLayout
from engine.messages.step import StepPlan


@attrs.frozen
class FlatBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    layouts: tuple[BatchLayout, ...]  # one per KV cache group (their block tables and slots differ)
    sample_rows: list[int]  # rows whose logits are sampled, request by request
    sample_owners: list  # the request owning each sample row
    sample_drafts: list[tuple[int, ...]]  # drafts before each sample row (they count as output there)
    spans: list[tuple[str, int, int]]  # (request id, first row, end row) per request
    prompt_rows: list[int]  # rows whose logits score the next prompt token
    prompt_targets: list[int]
    prompt_owners: list
    # (pooling request, first row, end row) per pooling request: its whole prompt is in this step
    pool_spans: list[tuple[object, int, int]] = attrs.Factory(list)

    @property
    def layout(self) -> BatchLayout:
        """The first KV cache group's layout."""
        return self.layouts[0]


def flatten(
    plan: StepPlan, group_tables: list[list[list[int]]], block_size: int | tuple[int, ...], device
) -> FlatBatch:
    """``group_tables``: per KV cache group, each scheduled request's block table; ``block_size``:
    tokens per block, one for every group or each group's (a state group's block spans a whole
    sequence: :func:`engine.runner.layer_attention.LayerAttention.group_block_sizes`)."""
    sizes = (block_size,) * len(group_tables) if isinstance(block_size, int) else block_size
    tokens: list[int] = []
    query_lens, seq_lens = [], []
    sample_rows, sample_owners, prompt_rows, prompt_targets, prompt_owners = [], [], [], [], []
    sample_drafts, spans, pool_spans = [], [], []
    for item in plan.scheduled:
        request, start, n = item.request, item.request.num_computed_tokens, item.num_new_tokens
        drafts = item.spec_token_ids
        offset = len(tokens)
        tokens += request.all_token_ids[start : start + n]
        tokens += drafts
        q = n + len(drafts)
        query_lens.append(q)
        seq_lens.append(start + q)
        spans.append((request.request_id, offset, offset + q))
        if request.pooling_params is not None:
            if start or n != request.num_prompt_tokens:
                raise ValueError(f"request {request.request_id} pools: its whole prompt must run in one step")
            pool_spans.append((request, offset, offset + q))
        if item.samples:
            sample_rows += range(offset + q - 1 - len(drafts), offset + q)
            sample_owners += [request] * (len(drafts) + 1)
            sample_drafts += [tuple(drafts[:j]) for j in range(len(drafts) + 1)]
        if request.sampling_params.prompt_logprobs is not None:
            last = min(start + n, request.num_prompt_tokens - 1)
            first = max(start, request.num_prompt_logprobs)  # positions sent before are not scored again
            prompt_rows += range(offset + first - start, offset + max(0, last - start))
            prompt_targets += request.prompt_token_ids[first + 1 : last + 1]
            prompt_owners += [request] * max(0, last - first)

    positions, layout = token_layout(query_lens, seq_lens, group_tables[0], sizes[0], device)
    layouts = (
        layout,
        *(
            token_layout(query_lens, seq_lens, tables, size, device)[1]
            for tables, size in zip(group_tables[1:], sizes[1:])
        ),
    )
    return FlatBatch(
        torch.tensor(tokens, dtype=torch.long, device=device),
        positions,
        layouts,
        sample_rows,
        sample_owners,
        sample_drafts,
        spans,
        prompt_rows,
        prompt_targets,
        prompt_owners,
        pool_spans,
    )


def token_layout(
    query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int, device
) -> tuple[torch.Tensor, BatchLayout]:
    """Positions and the attention layout of a flattened batch: sequence ``i`` contributes
    its last ``query_lens[i]`` tokens out of ``seq_lens[i]``, stored through its block table."""
    q_lens = np.array(query_lens, dtype=np.int64)
    s_lens = np.array(seq_lens, dtype=np.int64)
    owner = np.repeat(np.arange(len(q_lens)), q_lens)
    q_starts = np.concatenate([[0], np.cumsum(q_lens)])
    positions = (s_lens - q_lens)[owner] + np.arange(int(q_starts[-1])) - q_starts[:-1][owner]
    width = max(len(b) for b in block_tables)
    table = np.zeros((len(block_tables), width), dtype=np.int64)
    for row, blocks in enumerate(block_tables):
        table[row, : len(blocks)] = blocks
    slots = table[owner, positions // block_size] * block_size + positions % block_size
    layout = BatchLayout(
        query_start_loc=torch.from_numpy(q_starts.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(s_lens.astype(np.int32)).to(device),
        block_table=torch.from_numpy(table.astype(np.int32)).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        query_lens=tuple(query_lens),
        seq_lens_host=tuple(seq_lens),
    )
    return torch.from_numpy(positions).to(device), layout
