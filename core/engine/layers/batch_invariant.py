"""Batch invariance: a row's result must not depend on how many other rows share its call.

A CPU GEMM picks its blocking, micro-kernel and thread split from the matrix shape, and with
them the order in which each output's K products are summed, so the same token's logits
differ in their last bits between a batch of 1 and a batch of 64 — enough to flip a greedy
choice between two close tokens. With ``batch_invariant`` every matmul runs on tiles of
exactly ``ROWS`` rows (the last one padded with zeros): every row of every step meets the
same kernel on the same shape, whatever the batch. Rows do not interact inside a tile (a
row's outputs read only that row), so padding changes nothing but the time.

``ROWS`` = 16: a bf16 GEMM of 16 rows on this CPU runs at ~70 % of the 64-row rate, while
one row alone is memory-bound and costs about as much as sixteen.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ROWS = 16


def in_row_tiles(matmul: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``matmul`` applied to ``x`` [..., K] in tiles of exactly ``ROWS`` rows."""
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    if count == 0:
        return matmul(rows).reshape(*x.shape[:-1], -1)
    padded = -(-count // ROWS) * ROWS
    if padded != count:
        rows = torch.cat([rows, rows.new_zeros(padded - count, rows.shape[1])])
    out = torch.cat([matmul(rows[start : start + ROWS]) for start in range(0, padded, ROWS)])
    return out[:count].reshape(*x.shape[:-1], out.shape[-1])
