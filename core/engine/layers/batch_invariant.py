"""Batch invariance: a row's result must not depend on how many other rows share its call.

A CPU GEMM picks its blocking, micro-kernel and thread split from the matrix shape, and with
them the order in which each output's K products are summed, so the same token's logits
differ in their last bits between a batch of 1 and a batch of 64 — enough to flip a greedy
choice between two close tokens. Two ways to make every row meet the same sums:

- :func:`in_row_tiles` (defined with ``QuantMethod.apply_batch_invariant``, whose default it
  is), the safe one any kernel takes: tiles of exactly ``ROWS`` rows (the
  last one padded with zeros), so every row of every step meets the same kernel on the same
  shape. Rows do not interact inside a tile (a row's outputs read only that row), so padding
  changes nothing but the time. ``ROWS`` = 16: a bf16 GEMM of 16 rows on this CPU runs at
  ~70 % of the 64-row rate, while one row alone is memory-bound and costs about as much as
  sixteen.
- :func:`in_row_buckets`, the fast one: one call padded up to the smallest of
  ``CANDIDATE_BUCKETS`` rows that holds the batch, among the sizes at which this matmul was
  *probed* to give every row the same bits as 16-row tiles do. Which sizes those are depends
  on the library's kernel choice (oneDNN's blocking, the thread split), not on the values, so
  each (matmul kind, weight shape) is probed once per process, a size the first time a batch
  needs it (with the sizes below it), on random rows; a size that fails is never used, and a
  batch no passing size holds goes in calls of the largest one that passed. Bigger calls run
  the GEMM at its full rate: this is what brings ``--batch-invariant`` near bf16 throughput.

A kernel that gives each row the bits it gets alone by construction says so instead
(``invariant_rows``, :meth:`engine.layers.ops.LayerOps.pack_affine`: the most rows a call may
take, None for any number), and :func:`in_invariant_calls` runs it unpadded: a decode step is
then one plain call, which a native tape records.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable

import torch

from engine.interfaces.quant import ROWS, in_invariant_calls, in_row_tiles, takes_whole

__all__ = [
    "CANDIDATE_BUCKETS",
    "ROWS",
    "in_invariant_calls",
    "in_row_buckets",
    "in_row_tiles",
    "invariant_packing",
    "takes_whole",
]

# padded row counts a call may run at, each used only once probed (up to 1024 rows: a step's
# bigger matmuls are split into calls of the largest size that passed)
CANDIDATE_BUCKETS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)

Matmul = Callable[[torch.Tensor], torch.Tensor]


def invariant_packing(packed, batch_invariant: bool):
    """A platform's packed weight (:meth:`engine.layers.ops.LayerOps.pack_affine`) as the mode
    wants it: under ``batch_invariant``, its ``invariant_at_any_rows()`` where it offers one
    (every row count on one path: unpadded, whole calls); otherwise, or None, as it is."""
    invariant = getattr(packed, "invariant_at_any_rows", None)
    return invariant() if batch_invariant and callable(invariant) else packed


def in_row_buckets(matmul: Matmul, x: torch.Tensor, key: Hashable, kernel=None) -> torch.Tensor:
    """``matmul`` applied to ``x`` [..., K] in calls padded to probed buckets, bit for bit what
    :func:`in_row_tiles` gives. ``key`` names the matmul's kernel and shape (e.g. the weight's
    shape, dtype and whether it has a bias): calls sharing a key share the probes. Where
    ``kernel`` (``matmul``'s module) declares ``invariant_rows``, unpadded calls instead and no
    probe (:func:`in_invariant_calls`)."""
    declared = in_invariant_calls(kernel, matmul, x)
    if declared is not None:
        return declared
    rows = x.reshape(-1, x.shape[-1])
    count, start, pieces = rows.shape[0], 0, []
    if count == 0:
        return matmul(rows).reshape(*x.shape[:-1], -1)
    while start < count:
        take = min(count - start, CANDIDATE_BUCKETS[-1])
        bucket = _bucket(matmul, key, rows, take)
        take = min(take, bucket)
        pieces.append(matmul(_padded(rows[start : start + take], bucket))[:take])
        start += take
    out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _bucket(matmul: Matmul, key: Hashable, rows: torch.Tensor, count: int) -> int:
    """The smallest bucket of at least ``count`` rows that ``matmul`` passed its probe at, else
    the largest smaller one that passed (the call then takes that many rows), else ``ROWS``."""
    passed = ROWS
    for size in CANDIDATE_BUCKETS:
        if _row_invariant_at(key, size, matmul, rows.shape[1], rows.dtype, rows.device):
            if size >= count:
                return size
            passed = size
    return passed


_probed: dict[tuple[Hashable, int], bool] = {}


def _row_invariant_at(key: Hashable, size: int, matmul: Matmul, width: int, dtype, device) -> bool:
    """Whether ``matmul`` on ``size`` rows gives each row the bits 16-row tiles give it (probed
    once per key and size, on random rows drawn from a generator of their own, so the engine's
    random state is untouched)."""
    if size == ROWS:
        return True
    if (key, size) not in _probed:
        rows = _probe_rows(size, width, dtype, str(device))
        _probed[key, size] = torch.equal(matmul(rows), in_row_tiles(matmul, rows))
    return _probed[key, size]


@functools.cache
def _probe_rows(size: int, width: int, dtype, device: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(size)
    return torch.randn(size, width, generator=generator).to(dtype=dtype, device=device)


def _padded(rows: torch.Tensor, count: int) -> torch.Tensor:
    """``rows`` with zero rows appended up to ``count``."""
    if rows.shape[0] == count:
        return rows
    return torch.cat([rows, rows.new_zeros(count - rows.shape[0], rows.shape[1])])
