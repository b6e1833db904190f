"""``in_row_buckets``: one call padded to a probed row bucket gives every row the bits 16-row
tiles give it, and a size at which a kernel sums differently is never used."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers.batch_invariant import CANDIDATE_BUCKETS, in_row_buckets, in_row_tiles


def _weight(out: int, width: int) -> torch.Tensor:
    return torch.randn(out, width, generator=torch.Generator().manual_seed(out)).bfloat16()


@pytest.mark.parametrize("rows", [1, 15, 17, 100, 1030])
def test_buckets_give_the_tiles_bits(rows):
    weight = _weight(96, 64)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).bfloat16()

    def matmul(t):
        return F.linear(t, weight)

    assert torch.equal(in_row_buckets(matmul, x, ("test-linear", 96, 64)), in_row_tiles(matmul, x))


def test_a_size_that_sums_otherwise_is_never_used():
    """A kernel whose rows come out otherwise from 64 rows on (as a library switching blocking
    at a size would): its calls stay at 48 rows or fewer, and every row keeps the tiles' bits."""
    weight, calls = _weight(32, 64), []

    def switching(t):
        calls.append(t.shape[0])
        out = F.linear(t, weight)
        return out + 1 if t.shape[0] >= 64 else out

    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    expected = in_row_tiles(switching, x)
    calls.clear()
    assert torch.equal(in_row_buckets(switching, x, ("test-switching", 32, 64)), expected)
    failing = [size for size in CANDIDATE_BUCKETS if size >= 64]
    assert [n for n in calls if n >= 64] == failing  # each failing size ran once: its probe
    assert 48 in calls


class _Declaring(torch.nn.Module):
    """A kernel that declares ``invariant_rows``; its calls' row counts are kept. Small integers
    in float32: every sum exact in any order."""

    def __init__(self, invariant_rows):
        super().__init__()
        weight = torch.randint(-4, 5, (32, 64), generator=torch.Generator().manual_seed(3)).float()
        self.invariant_rows, self.weight, self.calls = invariant_rows, weight, []

    def forward(self, x):
        self.calls.append(x.shape[0])
        return F.linear(x, self.weight)


@pytest.mark.parametrize(
    ("declared", "calls"),
    [(None, [40]), (16, [16, 16, 8]), (0, [16, 16, 16]), ("undeclared", [16, 16, 16])],
)
def test_the_default_runs_a_declaring_kernel_unpadded(declared, calls):
    """``QuantMethod.apply_batch_invariant``'s default: where ``kernel_of(layer)`` declares
    ``invariant_rows``, calls of at most that many rows (one for None), no row padded; else 16-row
    tiles, the last padded. The rows are the same either way."""
    from engine.interfaces import QuantContext, QuantMethod

    kernel = _Declaring(declared)
    if declared == "undeclared":
        del kernel.invariant_rows

    class Method(QuantMethod):
        name = "declaring"

        def create_weights(self, layer, input_size, output_sizes):
            pass

        def kernel_of(self, layer):
            return kernel

        def apply(self, layer, x, bias):
            return kernel(x)

        def dequantize(self, layer):
            return kernel.weight

    method = Method(QuantContext(None, torch.float32, None, batch_invariant=True))
    x = torch.randint(-4, 5, (40, 64), generator=torch.Generator().manual_seed(2)).float()
    out = method.apply_batch_invariant(None, x, None)
    assert kernel.calls == calls and torch.equal(out, F.linear(x, kernel.weight))
