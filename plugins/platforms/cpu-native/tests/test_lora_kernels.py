"""LoRA's grouped shrink and expand in C, this CPU's build (AVX-512, or AVX2 + FMA) and the
portable one, against the torch reference ops on random segmented batches: ranks 8 to 64, odd
row counts (tiles of 8 rows with a remainder), rows of no adapter, every slot's rows in runs and
interleaved, a shard an adapter leaves out, padded input rows; adapters of different ranks in
the same slots, given their ranks (the shrink must read no row of A past them), and widths that
are not a vector multiple."""

import pytest
import torch

from engine.layers import LayerOps
from engine.native import load_source
from engine_platforms_cpu_native import kernels
from engine_platforms_cpu_native.ops import NativeLayerOps
from engine_platforms_cpu_native.platform import _native_ops

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=6e-2)}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def portable():
    library = load_source(kernels.SOURCE, portable=True)
    return {dtype: NativeLayerOps(library, dtype) for dtype in DTYPES}


def _batch(rows: int, rank: int, slots: int, output_sizes, layout: str, dtype, seed: int):
    """x (rows of a wider buffer), y, a, b, scale and indices of a random mixed batch."""
    gen = torch.Generator().manual_seed(seed)
    cols, n = 72, len(output_sizes)
    a = (torch.randn(slots, n, rank, cols, generator=gen) * 0.2).to(dtype)
    b = (torch.randn(slots, rank, sum(output_sizes), generator=gen) * 0.2).to(dtype)
    a[1, :, rank // 2 :], b[1, rank // 2 :] = 0, 0  # slot 1: an adapter of half the slots' rank
    scale = torch.rand(slots, n, generator=gen) + 0.5
    scale[0, -1] = 0  # slot 0 leaves its last shard out
    if layout == "runs":  # requests' rows in runs, as a prefill batch flattens them
        indices = torch.repeat_interleave(torch.tensor([-1, 2, 0, -1, 1, 2]), rows // 6 + 1)[:rows]
    else:
        indices = torch.randint(-1, slots, (rows,), generator=gen)
    x = torch.randn(rows, cols + 8, generator=gen).to(dtype)[:, :cols]
    y = torch.randn(rows, sum(output_sizes), generator=gen).to(dtype)
    return x, y, a, b, scale, indices


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("rank", [8, 16, 32, 64])
@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("layout", ["runs", "interleaved"])
def test_kernels_match_the_torch_ops(portable, dtype, rank, rows, layout):
    output_sizes = (48, 16, 16)
    x, y, a, b, scale, indices = _batch(rows, rank, 3, output_sizes, layout, dtype, rank * rows)
    torch_ops = LayerOps()
    h_ref = torch_ops.lora_shrink(x, a, scale, indices)
    expected = torch_ops.lora_expand(y.clone(), h_ref, b, indices, output_sizes)
    for ops in (_native_ops(dtype), portable[dtype]):
        h = ops.lora_shrink(x, a, scale, indices)
        torch.testing.assert_close(h, h_ref, **TOLERANCE[dtype])
        got = ops.lora_expand(y.clone(), h, b, indices, output_sizes)
        torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
        none = indices < 0
        assert torch.equal(got[none], y[none]), "rows of no adapter changed"
        assert torch.equal(h[none], torch.zeros_like(h[none]))


def test_a_big_batch_splits_over_threads_and_agrees_row_by_row():
    """A prefill-sized batch (threads split its tiles) gives each row what it gets alone."""
    ops, output_sizes = _native_ops(torch.bfloat16), (256, 64, 64)
    x, y, a, b, scale, indices = _batch(515, 16, 4, output_sizes, "interleaved", torch.bfloat16, 0)
    whole = ops.lora_expand(y.clone(), ops.lora_shrink(x, a, scale, indices), b, indices, output_sizes)
    for row in (0, 257, 514):
        one = slice(row, row + 1)
        alone = ops.lora_expand(
            y[one].clone(), ops.lora_shrink(x[one], a, scale, indices[one]), b, indices[one], output_sizes
        )
        assert torch.equal(whole[one], alone)


def test_a_slot_outside_the_slots_is_refused():
    ops = _native_ops(torch.float32)
    x, _, a, _, scale, _ = _batch(4, 8, 3, (16,), "runs", torch.float32, 0)
    with pytest.raises(IndexError):
        ops.lora_shrink(x, a, scale, torch.tensor([0, 3, -1, 1]))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("max_rank", [16, 64])
@pytest.mark.parametrize("rows", [1, 9, 40])
def test_the_shrink_reads_each_adapter_to_its_rank(portable, dtype, max_rank, rows):
    """Slots of rank 64 (or 16) holding adapters of ranks 8, 16, 32 and 64 (those that fit) in one
    interleaved batch with rows of none, odd widths (vector tails), each slot's rank given: rows
    of A past a slot's rank hold NaN, which a kernel reading them would spread into h. Against
    the torch ops on the same adapters with those rows zero."""
    gen = torch.Generator().manual_seed(max_rank + rows)
    slots, cols, output_sizes = 4, 77, (45, 13, 22)
    n = len(output_sizes)
    ranks = torch.tensor([min(r, max_rank) for r in (8, 16, 32, 64)])[:, None].repeat(1, n)
    ranks[2, 1] = 0  # slot 2 leaves its second shard out (and its scale is 0)
    a = torch.randn(slots, n, max_rank, cols, generator=gen) * 0.2
    b = torch.randn(slots, max_rank, sum(output_sizes), generator=gen) * 0.2
    scale = torch.rand(slots, n, generator=gen) + 0.5
    scale[2, 1] = 0
    for s in range(slots):
        b[s, int(ranks[s].max()) :] = 0
    indices = torch.randint(-1, slots, (rows,), generator=gen)
    x = torch.randn(rows, cols, generator=gen).to(dtype)
    y = torch.randn(rows, sum(output_sizes), generator=gen).to(dtype)
    past = torch.arange(max_rank)[None, None, :] >= ranks[:, :, None]  # [S, n, R]
    zeroed = a.masked_fill(past[..., None], 0).to(dtype)
    poisoned = a.masked_fill(past[..., None], float("nan"))
    torch_ops = LayerOps()
    h_ref = torch_ops.lora_shrink(x, zeroed, scale, indices)
    expected = torch_ops.lora_expand(y.clone(), h_ref, b.to(dtype), indices, output_sizes)
    for ops in (_native_ops(dtype), portable[dtype]):
        h = ops.lora_shrink(x, poisoned.to(dtype), scale, indices, ranks)
        torch.testing.assert_close(h, h_ref, **TOLERANCE[dtype])
        got = ops.lora_expand(y.clone(), h, b.to(dtype), indices, output_sizes)
        torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
        none = indices < 0
        assert torch.equal(got[none], y[none]), "rows of no adapter changed"


def test_a_rank_above_the_slots_is_refused():
    ops = _native_ops(torch.float32)
    x, _, a, _, scale, _ = _batch(4, 8, 3, (16,), "runs", torch.float32, 0)
    with pytest.raises(IndexError):
        ops.lora_shrink(x, a, scale, torch.tensor([0, 1, -1, 1]), torch.full((3, 1), 9))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("tile_rows", range(1, 9))
def test_every_tile_height_matches_torch_and_each_row_alone(portable, dtype, tile_rows):
    """One adapter's tile of 1 to 8 rows (the kernels' blocks are built per tile height: several
    rows of A or columns of B per block, then the ranks and columns left over one at a time,
    then the columns past the last vector), ranks 7 and 5 in rank-8 slots and widths that leave
    each kind of remainder: against the torch ops, and each row's result equal to what it gets
    alone (the sums' order does not depend on the tile)."""
    gen = torch.Generator().manual_seed(tile_rows)
    slots, rank, cols, output_sizes = 2, 8, 77, (45, 13, 70)
    n = len(output_sizes)
    ranks = torch.tensor([[7, 5, 8], [8, 8, 8]])
    a = torch.randn(slots, n, rank, cols, generator=gen) * 0.2
    a[0, 0, 7:], a[0, 1, 5:] = 0, 0
    a = a.to(dtype)
    b = (torch.randn(slots, rank, sum(output_sizes), generator=gen) * 0.2).to(dtype)
    scale = torch.rand(slots, n, generator=gen) + 0.5
    indices = torch.zeros(tile_rows, dtype=torch.int64)
    x = torch.randn(tile_rows, cols, generator=gen).to(dtype)
    y = torch.randn(tile_rows, sum(output_sizes), generator=gen).to(dtype)
    torch_ops = LayerOps()
    h_ref = torch_ops.lora_shrink(x, a, scale, indices)
    expected = torch_ops.lora_expand(y.clone(), h_ref, b, indices, output_sizes)
    for ops in (_native_ops(dtype), portable[dtype]):
        h = ops.lora_shrink(x, a, scale, indices, ranks)
        torch.testing.assert_close(h, h_ref, **TOLERANCE[dtype])
        got = ops.lora_expand(y.clone(), h, b, indices, output_sizes)
        torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
        for row in range(tile_rows):
            one = slice(row, row + 1)
            h_one = ops.lora_shrink(x[one], a, scale, indices[one], ranks)
            assert torch.equal(h_one, h[one])
            alone = ops.lora_expand(y[one].clone(), h_one, b, indices[one], output_sizes)
            assert torch.equal(alone, got[one])
