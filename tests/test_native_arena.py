"""The native tapes' arena (engine.native.arena): activations laid out by liveness, one block for
every tape of an engine, and tapes re-pointed when it moves. The kernels are the cpu-native
platform's own, recorded by engine.native.tape."""

from __future__ import annotations

import random

import pytest
import torch

from engine.native import arena, tape
from engine_platforms_cpu_native import kernels

pytestmark = pytest.mark.skipif(
    bool(tape.unavailable_reasons()), reason="; ".join(tape.unavailable_reasons())
)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


@pytest.mark.parametrize("seed", range(20))
def test_two_activations_share_bytes_only_where_their_lives_do_not_overlap(seed):
    """Random programs of ops addressing random storages: every storage an argument addresses
    gets room, aligned; two whose lives (first to last op addressing them, the output's to the
    end) overlap never share a byte; each moved argument keeps its offset inside its storage;
    an address in no storage is not moved."""
    rng = random.Random(seed)
    storages = [(0x10000 * (i + 1), rng.randrange(1, 5000)) for i in range(12)]
    ops = []
    for _ in range(30):
        arguments = []
        for slot in range(rng.randrange(1, 4)):
            start, size = rng.choice(storages)
            arguments.append((slot, start + rng.randrange(size)))
        arguments.append((5, 0x5))  # a pointer outside every storage (a weight, the KV cache)
        ops.append(arguments)
    output = rng.choice(storages)[0]
    layout = arena.plan(ops, storages, output)

    lives = {}
    for op, arguments in enumerate(ops):
        for _, address in arguments:
            for start, size in storages:
                if start <= address < start + size:
                    first, _ = lives.get(start, (op, op))
                    lives[start] = (first, len(ops) if start == output else op)
    assert set(layout.offsets) == set(lives)
    sizes = dict(storages)
    for a in lives:
        assert layout.offsets[a] % arena.ALIGN == 0 and layout.offsets[a] + sizes[a] <= layout.nbytes
        for b in lives:
            if a != b and _overlap((lives[a][0], lives[a][1] + 1), (lives[b][0], lives[b][1] + 1)):
                span_a = (layout.offsets[a], layout.offsets[a] + sizes[a])
                assert not _overlap(span_a, (layout.offsets[b], layout.offsets[b] + sizes[b]))
    moved = {(op, slot): offset for op, slot, offset in layout.moves}
    for op, arguments in enumerate(ops):
        for slot, address in arguments:
            inside = [s for s in storages if s[0] <= address < s[0] + s[1]]
            if not inside:
                assert (op, slot) not in moved
            else:
                assert moved[(op, slot)] == layout.offsets[inside[0][0]] + address - inside[0][0]


def test_a_chain_of_activations_fits_in_two_of_them():
    """a -> b -> c -> d, each read only by the next op: two slots of the largest hold them all."""
    storages = [(0x1000, 640), (0x2000, 640), (0x3000, 640), (0x4000, 640)]
    ops = [[(0, 0x1000)], [(0, 0x1000), (1, 0x2000)], [(0, 0x2000), (1, 0x3000)], [(0, 0x3000), (1, 0x4000)]]
    layout = arena.plan(ops, storages, output=0x4000)
    assert layout.nbytes == 2 * 640


def _kernel(symbol):
    return tape.bind(kernels.library(), symbol)


def _forward(table, ids, residual, weight, width):
    """Embedding rows gathered into a fresh buffer, SiLU-and-multiplied into another, then
    normalized with the residual: every activation allocated inside, as a model's forward's."""
    gather, silu, norm = _kernel("gather_rows"), _kernel("silu_and_mul_f32"), _kernel("add_rms_norm_f32")
    rows = ids.shape[0]

    def forward():
        gathered = torch.empty(rows, 2 * width)
        row_bytes = 8 * width  # 2 · width float32
        assert (
            gather(table.data_ptr(), table.shape[0], row_bytes, ids.data_ptr(), rows, gathered.data_ptr())
            == 0
        )
        out = torch.empty(rows, width)
        silu(gathered.data_ptr(), rows, 2 * width, width, out.data_ptr())
        norm(out.data_ptr(), residual.data_ptr(), weight.data_ptr(), rows, width, 1e-5)
        return out

    return forward


def test_tapes_in_one_arena_replay_what_eager_gives_after_it_moves():
    """A 3-row tape, then a 40-row one in the same arena (which grows: a new block): the first,
    replayed after, follows it — its kernels and its output tensor point into the new block — and
    both give what their forwards give eagerly on new inputs."""
    gen, width = torch.Generator().manual_seed(0), 64
    table, weight = torch.randn(50, 2 * width, generator=gen), torch.rand(width, generator=gen)
    shared = arena.Arena()
    cases = []
    for rows in (3, 40):
        ids, residual = torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, width)
        recorded, out = tape.record(_forward(table, ids, residual, weight, width), shared)
        assert out.untyped_storage().data_ptr() == shared.base and recorded.arena_bytes <= shared.nbytes
        cases.append((rows, ids, residual, recorded, out))
    assert shared.generation == 2
    for rows, ids, residual, recorded, out in reversed(cases):
        new_ids = torch.randint(0, 50, (rows,), generator=gen)
        new_residual = torch.randn(rows, width, generator=gen)
        ids.copy_(new_ids)
        residual.copy_(new_residual)
        recorded.replay()
        replayed, replayed_residual = out.clone(), residual.clone()
        assert out.untyped_storage().data_ptr() == shared.base
        ids.copy_(new_ids)
        residual.copy_(new_residual)
        eager = _forward(table, ids, residual, weight, width)()
        assert torch.equal(replayed, eager) and torch.equal(replayed_residual, residual)


def test_a_tape_keeps_none_of_the_activations_it_laid_out():
    """Once laid out, what the tape keeps holds no storage the forward allocated (the arena
    holds the activations), so their memory goes when the forward's last reference does."""
    width, rows = 64, 4
    table, weight = torch.randn(8, 2 * width), torch.ones(width)
    ids, residual = torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, width)
    with tape.recording() as recorder:
        out = _forward(table, ids, residual, weight, width)()
    allocated = {t.untyped_storage().data_ptr() for t in recorder.allocated}
    recorded = tape.Tape(recorder.calls, [*recorder.keep, out])
    recorded.lay_out(arena.Arena(), recorder.allocated, out)
    kept = {t.untyped_storage().data_ptr() for t in recorded._keep if isinstance(t, torch.Tensor)}
    assert len(allocated) == 2 and not kept & allocated
