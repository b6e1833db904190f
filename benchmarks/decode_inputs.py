"""Thread CPU time to put one decode step's inputs into a recorded bucket's static buffers: what a
native-tape replay does before its C call, every step. A tree with ``DecodeInputs.fill`` fills
them in place; an older one pads a copy (``pad_decode``) and copies it over, so the same script
compares two trees (run it with each tree's folders on ``PYTHONPATH``, alternated).

    python benchmarks/decode_inputs.py

Prints ``RESULT b<rows>-><bucket> <us>`` for a full bucket of 1 and of 16 rows and for 3 rows in a
4-row bucket (padding), each the best of 5 loops of 2000 calls.
"""

from __future__ import annotations

import time

import torch

from engine.runner import step_graphs
from engine.testing.attention import paged_layout

MAX_BLOCKS, BLOCK_SIZE = 16, 64


def put_inputs(rows: int, size: int):
    """A call that puts a decode step of ``rows`` requests (context ~100) into a ``size``-row bucket."""
    layout = paged_layout(
        [(100 + i, 1) for i in range(rows)], [[2 * i + 1, 2 * i + 2] for i in range(rows)], BLOCK_SIZE
    )
    ids, positions = torch.arange(rows), torch.arange(rows) + 100
    static = step_graphs.DecodeInputs.empty(size, MAX_BLOCKS, "cpu")
    if hasattr(static, "fill"):
        return lambda: static.fill(ids, positions, layout)
    return lambda: static.copy_(step_graphs.pad_decode(ids, positions, layout, size, MAX_BLOCKS))


def best_us(call, loops: int = 2000, rounds: int = 5) -> float:
    for _ in range(200):
        call()
    best = float("inf")
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(loops):
            call()
        best = min(best, (time.thread_time() - start) / loops)
    return best * 1e6


def main() -> None:
    figures = [
        f"b{rows}->{size} {best_us(put_inputs(rows, size)):.1f}us"
        for rows, size in ((1, 1), (16, 16), (3, 4))
    ]
    print("RESULT", " ".join(figures))


if __name__ == "__main__":
    main()
