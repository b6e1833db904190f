"""cpu-native's LM head on AMX int8 tiles (``logits_int8.c``): both builds bit for bit the plain
math they claim (the table rounded to int8 per row, the activations split in two int8 halves,
int32 sums, one float scaling), close to the exact product, and a vocabulary table's batched
logits on it with each row's largest still exact. And the greedy tokens from the head without
its logits, on those tiles and on the int8 kernel (``affine_logits_top``), the first maximum of
the logits either way."""

import pytest
import torch

from engine.layers.group_affine import AffineWeight
from engine_platforms_cpu_native import affine, kernels, logits
from engine_platforms_cpu_native.affine import PackedAffine
from engine_platforms_cpu_native.logits import Int8Table
from engine_platforms_cpu_native.platform import _native_ops

NO_AMX = pytest.mark.skipif(not logits.int8_tiles(), reason="this CPU has no AMX int8 tiles")


def _random_table(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)
    w[3] = 0.0  # a row of zeros: scale 0, logits 0
    return w


def _per_row(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's per-row scale of t (absmax / 127) and its inverse (0 for a zero row), each
    one float32 division as C rounds it (torch's division by a scalar multiplies by its
    reciprocal instead)."""
    most = t.abs().amax(dim=1, keepdim=True)
    steps = torch.full_like(most, 127.0)
    inverse = torch.where(most > 0, steps / most, torch.zeros_like(most))
    return most / steps, inverse


def _split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row of x as logits_int8 splits it: hi, lo (int64) and the row's scale a."""
    a, inverse = _per_row(x.float())
    v = x.float() * inverse
    hi = torch.round(v)
    lo = torch.round((v - hi) * 254.0)
    return hi.long(), lo.long(), a


def _plain_math(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    scale, inverse = _per_row(w)
    q, scale = torch.round(w * inverse).long(), scale.T
    hi, lo, a = _split(x)
    hi_sum, lo_sum = (hi @ q.T).float(), (lo @ q.T).float()
    return (hi_sum + lo_sum * torch.tensor(1 / 254.0)) * a * scale


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize(("n", "k"), [(75, 96), (300, 576), (32, 64)])
@pytest.mark.parametrize("rows", [1, 17, 40])
def test_both_builds_are_the_plain_math_bit_for_bit(portable, n, k, rows):
    """Columns not a multiple of the kernel's 32 (75), inputs not a multiple of its 64 (96: the
    zero-padded chunk), a zero row of the table and a zero row of activations, 1 to 40 rows
    (past a 16-row block): every logit the very float of the plain math."""
    gen = torch.Generator().manual_seed(n + k + rows)
    w = _random_table(n, k, gen)
    x = (torch.randn(rows, k, generator=gen) * torch.linspace(0.1, 8, k)).bfloat16()
    x[rows // 2] = 0.0
    table = Int8Table(lambda ids: w[ids], n, k, portable=portable)
    out = table(x)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    assert torch.equal(out, _plain_math(x, w))
    assert torch.equal(out[:, 3], torch.zeros(rows)) and torch.equal(out[rows // 2], torch.zeros(n))


def test_logits_past_the_caches_are_the_plain_math_too():
    """Over 32 MiB of logits (130 rows × 65 560 columns) the kernel streams them past the caches:
    whole vectors of aligned rows so, the others and the last panel's tail stored as before
    (rows of 262 240 bytes: every other one 64-byte aligned) — the same floats."""
    gen = torch.Generator().manual_seed(5)
    n, k, rows = 65_560, 64, 130
    w = _random_table(n, k, gen)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    out = Int8Table(lambda ids: w[ids], n, k)(x)
    assert rows * n * 4 > 32 << 20 and torch.equal(out, _plain_math(x, w))


def test_the_product_is_close_to_the_exact_one_and_packs_in_chunks(monkeypatch):
    """The rounding left is the table's per-row grid: within ~1 % of the logits' spread here;
    and a table packed ``PACK_ROWS`` rows at a time is the one packed whole."""
    gen = torch.Generator().manual_seed(5)
    n, k = 200, 256
    w, x = _random_table(n, k, gen), torch.randn(24, k, generator=gen).bfloat16()
    whole = Int8Table(lambda ids: w[ids], n, k)
    monkeypatch.setattr(logits, "PACK_ROWS", 64)
    chunked = Int8Table(lambda ids: w[ids], n, k)
    assert torch.equal(whole.w8, chunked.w8) and torch.equal(whole.scale, chunked.scale)
    exact = x.double() @ w.double().T
    error = (whole(x).double() - exact).std(dim=1) / exact.std(dim=1)
    assert error.max() < 0.01
    assert whole.nbytes == whole.w8.numel() + 4 * whole.scale.numel() >= n * k


def _vocab_table(gen: torch.Generator, n: int = 300, k: int = 576) -> AffineWeight:
    q = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // 32, generator=gen) + 0.5) * 0.01
    return AffineWeight(q, scale.half().float(), (scale.half() * -128).float(), 32, 8)


@NO_AMX
def test_a_vocabulary_tables_batched_logits_take_the_int8_copy_with_the_largest_exact():
    """``prepare_logits`` gives a table on the tiles its int8 copy; then logits over more than
    ``TILE_ROWS`` rows are that copy's product with each row's ``LOGITS_REFINED`` largest the
    same exact values as the kernel's path; up to ``TILE_ROWS`` rows nothing changes."""
    gen = torch.Generator().manual_seed(7)
    weight = _vocab_table(gen)
    packed, plain = PackedAffine(weight, torch.bfloat16), PackedAffine(weight, torch.bfloat16)
    packed.prepare_logits()
    assert packed.int8_table is not None and plain.int8_table is None
    x = torch.randn(affine.TILE_ROWS + 9, weight.shape[1], generator=gen).bfloat16()
    batched = packed.logits(x)
    by_kernel = torch.cat([packed.logits(x[i : i + 1]) for i in range(x.shape[0])])
    top = by_kernel.topk(affine.LOGITS_REFINED, dim=-1)
    assert torch.equal(batched.gather(1, top.indices[:, :8]), top.values[:, :8])
    copy = packed.int8_table(x)
    refined = batched != copy
    assert refined.sum(dim=1).le(affine.LOGITS_REFINED).all()
    exact = x.float() @ weight.dequantize(torch.float32).T
    torch.testing.assert_close(batched, exact, rtol=0, atol=0.02 * exact.std().item())
    few = x[: affine.TILE_ROWS]
    assert torch.equal(packed.logits(few), plain.logits(few))
    mib = packed.int8_table.nbytes / 2**20
    notes = _native_ops(torch.bfloat16).notes(torch.nn.ModuleList([packed]))
    copy = f"AMX: the LM head's batched steps on int8 tiles, from an int8 copy of its table ({mib:.1f} MiB)"
    assert copy in notes


def test_no_copy_off_the_tiles(monkeypatch):
    """Off AMX (``ENGINE_CPU_AMX_TILES=0``, float32 activations, or a CPU without tiles) a
    vocabulary table keeps no int8 copy."""
    weight = _vocab_table(torch.Generator().manual_seed(8))
    float32 = PackedAffine(weight, torch.float32)
    float32.prepare_logits()
    assert float32.int8_table is None
    monkeypatch.setenv(kernels.TILES_VARIABLE, "0")
    assert not logits.int8_tiles()
    off = PackedAffine(weight, torch.bfloat16)
    off.prepare_logits()
    assert off.int8_table is None
    assert not logits.kernels(portable=True)["logits_int8_amx"]()


def _top_by_value_then_column(out: torch.Tensor, top: int) -> list[list[tuple[float, int]]]:
    """Each row's ``top`` largest (value, column), ranked by value, then the lower column first."""
    return [sorted((-v, c) for c, v in enumerate(row.tolist()))[:top] for row in out]


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize(("n", "rows", "top"), [(75, 17, 32), (300, 40, 32), (4000, 33, 32), (40, 20, 40)])
def test_each_rows_top_is_the_one_a_pass_over_its_logits_keeps(portable, n, rows, top):
    """``Int8Table.top`` writes no logit, yet keeps each row's ``top`` largest of the very logits
    the table gives, ties (repeated table rows) to the lower column, whatever thread saw which
    columns; a row it cannot rank (more equal values than it keeps, 256 a thread: a zero row of
    activations over 4 000 columns) comes back NaN."""
    gen = torch.Generator().manual_seed(n + rows)
    k = 96
    w = _random_table(n, k, gen)
    w[n // 2 :: n // 8] = w[1]  # the same logit in several columns
    x = (torch.randn(rows, k, generator=gen) * torch.linspace(0.1, 8, k)).bfloat16()
    x[rows // 3] = 0.0
    table = Int8Table(lambda ids: w[ids], n, k, portable=portable)
    out = table(x)
    best, values = table.top(x, top)
    want = _top_by_value_then_column(out, top)
    unranked = values.isnan().all(dim=1).nonzero().flatten().tolist()
    assert unranked in ([], [rows // 3]) and (unranked or n < 4000)
    for r in range(rows):
        if r not in unranked:
            assert sorted(zip((-values[r]).tolist(), best[r].tolist())) == want[r]


def _greedy_case(n: int, k: int, rows: int, gen: torch.Generator, **options):
    """A vocabulary table (repeated rows: equal logits in many columns) and activations with a
    zero row (every logit equal), a NaN row and a row equal to one of the table's."""
    weight = _vocab_table(gen, n, k)
    repeats = slice(n // 3, None, max(1, n // 6))
    weight.q[repeats] = weight.q[2]
    weight.scale[repeats], weight.offset[repeats] = weight.scale[2], weight.offset[2]
    packed = PackedAffine(weight, torch.bfloat16, **options)
    packed.prepare_logits()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    x[1], x[2, 5] = 0.0, float("nan")
    x[3] = weight.dequantize(torch.float32)[2].bfloat16() * 4
    return packed, x, weight


def _tiles_case(n: int, k: int, rows: int, gen: torch.Generator, tiles: str):
    """``_greedy_case`` on the tile path: AMX's (``tiles="amx"``), or the plain-C build of the
    same kernels (``"plain"``, the same bits: test_conformance's tile product tests), which any
    CPU runs."""
    if tiles == "amx":
        return _greedy_case(n, k, rows, gen)
    packed, x, weight = _greedy_case(n, k, rows, gen, portable=True)
    packed._tiles = affine.kernels(portable=True)["affine_matmul_amx"]
    packed.int8_table = Int8Table(lambda ids: packed.rows(ids, torch.float32), n, k, portable=True)
    return packed, x, weight


TILES = [pytest.param("amx", marks=NO_AMX), "plain"]


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize(("n", "rows"), [(300, 17), (2000, 70), (20, 24), (33, 300)])
def test_the_greedy_tokens_are_the_first_maximum_of_the_logits(n, rows, tiles, monkeypatch):
    """``PackedAffine.greedy`` (no logits written) gives each row the first maximum of
    ``logits``: flat rows (zero activations), NaN rows, ties between repeated columns, a
    vocabulary smaller than the refined count, more rows than a 256-row pass. The rows the
    candidates cannot settle (NaN; flat, where equal logits were left out) take the logits."""
    from engine.native.rows import first_max

    packed, x, _ = _tiles_case(n, 576, rows, torch.Generator().manual_seed(n + rows), tiles)
    made, unsettled = [], packed.int8_table.unsettled

    def counted(x, tokens, out):
        made.append(int((tokens < 0).sum()))
        unsettled(x, tokens, out)

    monkeypatch.setattr(packed.int8_table, "unsettled", counted)
    assert torch.equal(packed.greedy(x), first_max(packed.logits(x)))
    # the NaN row, and the flat one where equal logits were left out
    assert made == [2 if n > affine.LOGITS_REFINED else 1]
    few = x[: affine.TILE_ROWS]  # not on the tiles: the int8 kernel's candidates
    assert torch.equal(packed.greedy(few), first_max(packed.logits(few)))


@pytest.mark.parametrize("tiles", TILES)
def test_the_greedy_tokens_on_the_tiles_replay_from_a_native_tape(tiles):
    """On the tiles the greedy head is kernel calls alone, the unsettled rows' logits and their
    settling included, so a native tape records it (as the step graphs' greedy recordings do)
    and its replays give each new input's tokens, its unsettled rows wherever they lie."""
    from engine.native import tape
    from engine.native.rows import first_max

    gen = torch.Generator().manual_seed(11)
    packed, x, _ = _tiles_case(300, 576, affine.TILE_ROWS + 4, gen, tiles)
    inputs = x.clone()
    recorded, tokens = tape.record(lambda: packed.greedy(inputs))
    for shift in (0, 5, 9):
        other = torch.randn(x.shape, generator=gen).bfloat16()
        other[shift], other[shift + 1, 7] = 0.0, float("nan")  # a flat row, a NaN row
        inputs.copy_(other)
        recorded.replay()
        assert torch.equal(tokens, first_max(packed.logits(other)))


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize(("n", "rows"), [(300, 4), (75, 17), (4000, 33), (20, 5)])
def test_the_kernels_top_is_the_one_a_pass_over_its_one_pass_logits_keeps(portable, n, rows):
    """``affine_logits_top`` (on VNNI the product keeps each row's candidates and writes no
    logit; other builds write them and pass over each row) keeps each row's ``top`` largest of
    the int8 kernel's one-pass logits (its float32 ``forward`` on the same values), ties
    (repeated table rows) to the lower column, whatever thread saw which columns; a row VNNI's
    candidates cannot rank (a zero row of activations over 4 000 columns: more equal values than
    they hold) comes back NaN."""
    gen = torch.Generator().manual_seed(n + rows)
    packed, x, weight = _greedy_case(n, 96, rows, gen, portable=portable, tiles=False)
    x[2] = 1.0  # no NaN row here
    top = min(affine.LOGITS_REFINED, n)
    one_pass = PackedAffine(weight, torch.float32, portable=portable)(x.float())
    best = torch.empty(rows, top, dtype=torch.int64)
    values = torch.empty(rows, top, dtype=torch.float32)
    kernel = affine.kernels(portable)["affine_logits_top_bf16"]
    packed._run(kernel, x, torch.float32, top, best.data_ptr(), out=values)
    want = _top_by_value_then_column(one_pass, top)
    unranked = values.isnan().all(dim=1).nonzero().flatten().tolist()
    if affine.kernels(portable)["affine_simd_width"]() == 512:  # VNNI keeps candidates, 256 a thread
        assert unranked in ([], [1]) and (unranked or n < 4000)
    else:  # the others pass over written logits: every row ranked
        assert unranked == []
    for r in range(rows):
        if r not in unranked:
            assert sorted(zip((-values[r]).tolist(), best[r].tolist())) == want[r]


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize(("n", "rows"), [(300, 4), (2000, 70), (20, 24), (33, 300)])
def test_the_kernels_greedy_tokens_are_the_first_maximum_of_its_logits(portable, n, rows):
    """Off the tiles (the int8 kernel: every step on a CPU without AMX, and up to ``TILE_ROWS``
    rows on one with it) ``PackedAffine.greedy`` gives each row the first maximum of ``logits``,
    flat, NaN and tied rows included, in either build; a single row takes the logits."""
    from engine.native.rows import first_max

    gen = torch.Generator().manual_seed(n + rows)
    packed, x, _ = _greedy_case(n, 576, rows, gen, portable=portable, tiles=False)
    assert torch.equal(packed.greedy(x), first_max(packed.logits(x)))
    assert packed.greedy(x[:1]) is None


@pytest.mark.parametrize("tiles", TILES)
def test_a_weight_on_the_tiles_keeps_each_rows_bits_up_to_a_tile_of_rows(tiles):
    """``invariant_rows`` on the tiles is ``TILE_ROWS``: calls of that many rows or fewer take the
    int8 kernel, which gives each row the bits it gets alone (``forward``, ``logits`` and
    ``greedy``'s first maximum; a flat row and a NaN row among them); the tiles above differ.
    ``invariant_at_any_rows`` keeps it off them: then any number."""
    from engine.native.rows import first_max

    packed, x, _ = _tiles_case(300, 576, 40, torch.Generator().manual_seed(5), tiles)
    assert packed.invariant_rows == affine.TILE_ROWS
    few = affine.TILE_ROWS
    for kernel in (packed, packed.logits):
        alone = torch.cat([kernel(x[i : i + 1]) for i in range(few)])
        for count in (2, 5, few):
            torch.testing.assert_close(kernel(x[:count]), alone[:count], rtol=0, atol=0, equal_nan=True)
    logits = torch.cat([packed.logits(x[i : i + 1]) for i in range(few)])
    assert torch.equal(packed.greedy(x[:few]), first_max(logits))
    assert not torch.equal(packed(x)[3:few], packed(x[:few])[3:])  # rows 1, 2: the flat and NaN ones
    # kept off the tiles (as --batch-invariant asks), all 40 rows in one call are their own
    assert packed.invariant_at_any_rows() is packed and packed.invariant_rows is None
    alone = torch.cat([packed(x[i : i + 1]) for i in range(x.shape[0])])
    torch.testing.assert_close(packed(x), alone, rtol=0, atol=0, equal_nan=True)
