"""mla.c's decode kernel called directly against plain torch math on random paged latent caches:
DeepSeek's latent sizes (rank 512, rope 64) and a small one, 16 heads and an odd 5, bf16 and
float32 caches, ragged contexts (not block multiples) over block tables shuffled over the pool;
the AVX2 symbol, the portable symbol of the same build, and the build for the compiler's baseline
instruction set (no AVX2). A row's result is its own: the same bits alone or in a batch, on one
thread or two."""

import functools

import pytest
import torch

from engine.native import load_source
from engine.native.tape import bind
from engine_attention_cpu_native import mla

CONTEXTS = [1, 17, 300, 64, 129, 5]
BLOCK = 16
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-5}  # the float32 math on the same stored values


@functools.cache
def portable_build():
    return load_source(mla.SOURCE, portable=True)


def kernel(build: str, dtype: torch.dtype):
    suffix = mla._SUFFIX[dtype]
    if build == "portable-build":
        return bind(portable_build(), f"mla_decode_{suffix}")
    return mla.kernel(dtype, portable=build == "scalar")


def paged_inputs(heads: int, rank: int, rope: int, dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    per_row = [-(-n // BLOCK) for n in CONTEXTS]
    pool = sum(per_row) + 3
    order = (torch.randperm(pool - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(CONTEXTS), max(per_row), dtype=torch.int32)
    for r, n in enumerate(per_row):
        table[r, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    cache = torch.randn(pool, BLOCK, rank + rope, generator=gen).to(dtype)
    query = torch.randn(len(CONTEXTS), heads, rank + rope, generator=gen)
    return query, cache, table, torch.tensor(CONTEXTS, dtype=torch.int32)


def run(fn, query, cache, table, seq_lens, rank: int, scale: float) -> torch.Tensor:
    rows, heads, entry = query.shape
    out = torch.full((rows, heads, rank), float("nan"))
    status = fn(
        query.data_ptr(),
        cache.data_ptr(),
        table.data_ptr(),
        table.stride(0),
        seq_lens.data_ptr(),
        rows,
        heads,
        rank,
        entry - rank,
        BLOCK,
        scale,
        out.data_ptr(),
    )
    assert status == 0
    return out


def plain_math(query, cache, table, seq_lens, rank: int, scale: float) -> torch.Tensor:
    """Each row's pages gathered, scores and softmax in float64, the latents weighted."""
    outs = []
    for r, n in enumerate(seq_lens.tolist()):
        vectors = cache[table[r]].flatten(0, 1)[:n].double()  # [n, entry]
        weights = (query[r].double() @ vectors.T * scale).softmax(-1)  # [H, n]
        outs.append(weights @ vectors[:, :rank])
    return torch.stack(outs)


@pytest.mark.parametrize("build", ["avx2", "scalar", "portable-build"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(16, 512, 64), (5, 32, 8)], ids=["deepseek-16-heads", "small-5-heads"])
def test_matches_plain_math(build, dtype, shape):
    heads, rank, rope = shape
    query, cache, table, seq_lens = paged_inputs(heads, rank, rope, dtype)
    scale = (128 + rope) ** -0.5
    out = run(kernel(build, dtype), query, cache, table, seq_lens, rank, scale)
    expected = plain_math(query, cache, table, seq_lens, rank, scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_rows_bits_are_its_own(dtype):
    """Alone or among the batch, on one thread or two (heads tiled differently): the same bits."""
    heads, rank, rope = 16, 512, 64
    query, cache, table, seq_lens = paged_inputs(heads, rank, rope, dtype, seed=3)
    fn, scale = mla.kernel(dtype), 0.1
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = run(fn, query, cache, table, seq_lens, rank, scale)
        torch.set_num_threads(1)
        single_thread = run(fn, query, cache, table, seq_lens, rank, scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, single_thread)
    for r in range(len(CONTEXTS)):
        alone = run(fn, query[r : r + 1], cache, table[r : r + 1], seq_lens[r : r + 1], rank, scale)
        assert torch.equal(alone[0], batch[r])
