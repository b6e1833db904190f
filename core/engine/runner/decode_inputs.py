"""A decode step's inputs in static buffers, as step graphs read them (:mod:`engine.runner.step_graphs`):
every bucket's a prefix of the largest's, written in place each step (``fill``, padded as
:func:`pad_decode` pads), or moved on by the tokens a step chose (``advance``: the next step of
a burst)."""

from __future__ import annotations

import attrs
import torch

from engine.interfaces import BatchLayout
from engine.native.decode import advance_kernel


@attrs.frozen
class DecodeInputs:
    """A decode step's inputs at a fixed batch size (the static buffers' shapes)."""

    input_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    layout: BatchLayout  # block_table [B, max_blocks]

    @classmethod
    def empty(cls, size: int, max_blocks: int, device) -> DecodeInputs:
        """All padding: what the graph is recorded over."""
        zeros = torch.zeros(size, dtype=torch.int64, device=device)
        return cls(
            zeros,
            zeros.clone(),
            BatchLayout(
                query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),
                seq_lens=torch.ones(size, dtype=torch.int32, device=device),
                block_table=torch.zeros(size, max_blocks, dtype=torch.int32, device=device),
                slot_mapping=torch.zeros(size, dtype=torch.int64, device=device),
                query_lens=(1,) * size,
                seq_lens_host=(1,) * size,
            ),
        )

    def prefix(self, size: int) -> DecodeInputs:
        """The first ``size`` rows of these buffers, as the inputs of a ``size``-row step: every
        bucket's inputs are views of the largest's (one replays at a time, each after its
        :meth:`fill`), so the buckets add no memory of their own — a block table row is
        ``max_blocks`` entries, 2 KiB at 8 192 positions."""
        layout = self.layout
        return DecodeInputs(
            self.input_ids[:size],
            self.positions[:size],
            BatchLayout(
                query_start_loc=layout.query_start_loc[: size + 1],
                seq_lens=layout.seq_lens[:size],
                block_table=layout.block_table[:size],
                slot_mapping=layout.slot_mapping[:size],
                query_lens=(1,) * size,
                seq_lens_host=(1,) * size,
            ),
        )

    def copy_(self, other: DecodeInputs) -> None:
        """Overwrite these buffers in place with ``other`` of the same shapes."""
        for mine, theirs in (
            (self.input_ids, other.input_ids),
            (self.positions, other.positions),
            *(
                (getattr(self.layout, f), getattr(other.layout, f))
                for f in ("query_start_loc", "seq_lens", "block_table", "slot_mapping")
            ),
        ):
            mine.copy_(theirs, non_blocking=True)

    def advance(self, tokens: torch.Tensor, block_size: int) -> None:
        """Move every row on by one decoded token, in place: ``tokens`` [size] its input, the
        position and length one more, the slot the block table gives the new position (a padding
        row's table is the null block throughout: its keys stay there). On the CPU one C call
        (:mod:`engine.native.decode`), which a native tape records; elsewhere torch ops."""
        table, seq_lens, slots = self.layout.block_table, self.layout.seq_lens, self.layout.slot_mapping
        kernel = advance_kernel() if self.input_ids.device.type == "cpu" else None
        if kernel is not None:
            kernel(
                tokens.data_ptr(),
                self.input_ids.data_ptr(),
                self.positions.data_ptr(),
                seq_lens.data_ptr(),
                slots.data_ptr(),
                table.data_ptr(),
                table.stride(0),
                block_size,
                self.input_ids.shape[0],
            )
            return
        self.input_ids.copy_(tokens)
        self.positions.add_(1)
        seq_lens.add_(1)
        blocks = table.gather(1, (self.positions // block_size).unsqueeze(1)).squeeze(1)
        torch.add(blocks.long() * block_size, self.positions % block_size, out=slots)

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout) -> None:
        """Write a uniform decode step of B ≤ size requests into these buffers in place, padded
        as :func:`pad_decode` pads it. A replay's inputs every step: half the torch ops of
        padding a copy and copying it over (~0.1 ms of a 6.5 ms single-stream step, one
        thread). ``query_start_loc`` is left as it is: every size's is ``arange(size + 1)``."""
        size, (rows, width) = self.input_ids.shape[0], layout.block_table.shape
        table = self.layout.block_table
        if rows > size or width > table.shape[1]:
            raise ValueError(
                f"a decode step of {rows} requests and {width} blocks does not fit "
                f"a {size}-row graph of {table.shape[1]} blocks"
            )
        vectors = (
            (self.input_ids, input_ids, 0),
            (self.positions, positions, 0),
            (self.layout.seq_lens, layout.seq_lens, 1),
            (self.layout.slot_mapping, layout.slot_mapping, 0),
        )
        for mine, theirs, _ in vectors:
            mine[:rows].copy_(theirs, non_blocking=True)
        table[:rows, :width].copy_(layout.block_table, non_blocking=True)
        if width < table.shape[1]:
            table[:rows, width:].zero_()
        if rows < size:
            for mine, _, pad in vectors:
                mine[rows:].fill_(pad)
            table[rows:].zero_()


def pad_decode(
    input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout, size: int, max_blocks: int
) -> DecodeInputs:
    """A uniform decode step of B ≤ ``size`` requests as ``size`` rows: padding rows are token
    0 at position 0 with one key, written to and read from slot 0 of the null block; the block
    table widened to ``max_blocks`` columns with the null block."""
    padded = DecodeInputs.empty(size, max_blocks, input_ids.device)
    padded.fill(input_ids, positions, layout)
    pad = size - layout.num_requests
    return attrs.evolve(
        padded, layout=attrs.evolve(padded.layout, seq_lens_host=(*layout.seq_lens_host, *(1,) * pad))
    )
