"""Attention backend contract: the backend against plain math on random paged inputs —
prefill, decode and mixed batches, a long later prefill chunk, GQA, several block sizes,
lengths that are not block multiples, blocks scattered in the pool; and the attention kinds a
spec may ask for (a sliding window, soft-capped logits, another query scale), alone and
together, where a window's out-of-reach blocks are the null block (as the KV cache manager
leaves them) holding garbage. The context a batch attends over is written by the backend itself
in an earlier call, so any cache layout passes that reads back what it wrote through the slot
mapping."""

from __future__ import annotations

import pytest
import torch

from engine.builtin.platforms import CpuPlatform
from engine.interfaces import AttentionSpec, BatchLayout
from engine.plugins import load_plugins

# (context already cached, new query tokens) per request
BATCHES = {
    "prefill": [(0, 7), (0, 33), (0, 1)],
    "chunked-prefill": [(16, 9), (5, 20)],
    "decode": [(1, 1), (15, 1), (16, 1), (40, 1), (0, 1)],
    "decode-single": [(37, 1)],
    "mixed": [(30, 1), (0, 19), (9, 1), (12, 6), (47, 1)],
    "decode-ragged": [(2, 1), (90, 1), (3, 1), (5, 1), (120, 1), (1, 1), (7, 1), (100, 1), (4, 1), (6, 1)],
    # a long later chunk beside decode rows: many query tiles over a long cached prefix
    "long-later-chunk": [(5, 1), (301, 150), (12, 1)],
}


# attention kinds beside the plain one: AttentionSpec fields
KINDS = {
    "window": dict(sliding_window=12),
    "softcap": dict(logit_softcap=2.0),
    "window-softcap-scale": dict(sliding_window=7, logit_softcap=1.5, query_scale=0.3),
}


def reference_attention(q, keys, values, scale, sliding_window=None, logit_softcap=None,
                        causal: bool = True):
    """q [q, H, D] over a sequence's whole keys/values [L, Hkv, D]; causal, last q positions;
    each query sees the ``sliding_window`` keys ending at its own (None: all), logits
    soft-capped as cap · tanh(logits / cap); ``causal=False``: every row over the whole
    sequence (no window then)."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).double()
    v = values.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if logit_softcap is not None:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    length, n = keys.shape[0], q.shape[0]
    key_pos, query_pos = torch.arange(length)[None, :], (length - n + torch.arange(n))[:, None]
    if causal:
        allowed = key_pos <= query_pos
        if sliding_window is not None:
            allowed &= key_pos > query_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _beyond_window(tables, requests, block_size: int, window: int | None):
    """The tables with each block wholly before every new query's window set to the null block."""
    if window is None:
        return tables
    return [[0 if (i + 1) * block_size <= ctx - window + 1 else b for i, b in enumerate(t)]
            for t, (ctx, _) in zip(tables, requests)]


def _layout(requests, tables, block_size, first: bool) -> BatchLayout:
    """Layout of call 1 (each request's cached context) or call 2 (its new tokens)."""
    lens, seqs, slots = [], [], []
    for (ctx, n), blocks in zip(requests, tables):
        start, count = (0, ctx) if first else (ctx, n)
        if count == 0:
            continue
        positions = torch.arange(start, start + count)
        slots.append(torch.tensor(blocks)[positions // block_size] * block_size + positions % block_size)
        lens.append(count)
        seqs.append(start + count)
    active = [t for (ctx, n), t in zip(requests, tables) if (ctx if first else n)]
    table = torch.zeros(len(active), max(len(t) for t in active), dtype=torch.int32)
    for i, t in enumerate(active):
        table[i, :len(t)] = torch.tensor(t)
    return BatchLayout(
        query_start_loc=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32),
        seq_lens=torch.tensor(seqs, dtype=torch.int32), block_table=table,
        slot_mapping=torch.cat(slots).long(), query_lens=tuple(lens), seq_lens_host=tuple(seqs))


def fused_projection_views(q, k, v, row_padding: int = 16):
    """q [T, H, D], k and v [T, Hkv, D] as a model hands them over: head views into one fused
    q|k|v matmul output [T, (H + 2·Hkv)·D + row_padding] — neither of them contiguous, rows
    further apart than their heads, padding NaN (a backend that reads it fails)."""
    tokens, widths = q.shape[0], [t.shape[1] * t.shape[2] for t in (q, k, v)]
    fused = torch.full((tokens, sum(widths) + row_padding), float("nan"), dtype=q.dtype)
    parts = fused[:, :sum(widths)].split(widths, dim=1)
    return tuple(part.view(t.shape).copy_(t) for part, t in zip(parts, (q, k, v)))


def run_two_calls(backend, spec: AttentionSpec, requests, num_blocks: int, seed: int = 0):
    """Call 1 writes every request's context (a prefill, itself checked); call 2 runs the
    batch under test over it. Blocks are scattered over the pool; q, k and v are strided
    views of one fused projection (:func:`fused_projection_views`). The cache layout is the
    backend's own: only outputs are compared. -> [(output, expected)] per call."""
    gen = torch.Generator().manual_seed(seed)
    bs = spec.block_size
    cache = torch.zeros(backend.kv_cache_shape(num_blocks), dtype=spec.dtype)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = [[free.pop() for _ in range(-(-(ctx + n) // bs))] for ctx, n in requests]
    seqs = [tuple(torch.randn(ctx + n, h, spec.head_dim, generator=gen).to(spec.dtype)
                  for h in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads)) for ctx, n in requests]
    results = []
    for first in (True, False):
        if first and not any(ctx for ctx, _ in requests):
            continue
        if not first and spec.sliding_window is not None:
            cache.select(backend.block_dim, 0).copy_(torch.randn(cache.select(backend.block_dim, 0).shape,
                                                                 generator=gen))
        layout = _layout(requests, tables if first else _beyond_window(tables, requests, bs, spec.sliding_window),
                         bs, first)
        pick = [(ctx, n, s) for (ctx, n), s in zip(requests, seqs) if (ctx if first else n)]
        span = [(0, ctx) if first else (ctx, ctx + n) for ctx, n, _ in pick]
        q, k, v = (torch.cat([s[i][a:b] for (a, b), (_, _, s) in zip(span, pick)]) for i in range(3))
        q, k, v = fused_projection_views(q, k, v)
        out = backend.forward(q, k, v, cache, backend.build_metadata(layout))
        expected = torch.cat([reference_attention(s[0][a:b], s[1][:b], s[2][:b], spec.scale, spec.sliding_window,
                                                  spec.logit_softcap, spec.causal)
                              for (a, b), (_, _, s) in zip(span, pick)])
        results.append((out, expected))
    return results


class AttentionBackendContract:
    backend_name: str
    platform_cls = CpuPlatform
    dtype_tolerances = {torch.float32: 2e-4, torch.bfloat16: 3e-2}

    @pytest.fixture
    def backend_cls(self):
        return load_plugins().get("attention_backends", self.backend_name)

    @pytest.mark.parametrize("batch", sorted(BATCHES))
    @pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
    @pytest.mark.parametrize("block_size", [8, 16])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    def test_matches_reference(self, backend_cls, batch, heads, block_size, dtype):
        spec = AttentionSpec(num_heads=heads[0], num_kv_heads=heads[1], head_dim=32, dtype=dtype,
                             block_size=block_size)
        platform = self.platform_cls()
        if backend_cls.supports(spec, platform):
            pytest.skip(f"{self.backend_name} does not support {spec}: {backend_cls.supports(spec, platform)}")
        backend = backend_cls(spec, platform)
        tol = self.dtype_tolerances[dtype]
        for out, expected in run_two_calls(backend, spec, BATCHES[batch], num_blocks=64):
            assert out.shape == expected.shape
            torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)

    @pytest.mark.parametrize("batch", sorted(BATCHES))
    @pytest.mark.parametrize("kind", sorted(KINDS))
    @pytest.mark.parametrize("invariant", [False, True], ids=["batched", "batch-invariant"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    def test_attention_kinds_match_reference(self, backend_cls, batch, kind, invariant, dtype):
        """Grouped-query heads, 8-token blocks; a backend that does not support the kind says so."""
        spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=32, dtype=dtype, block_size=8,
                             batch_invariant=invariant, **KINDS[kind])
        platform = self.platform_cls()
        reasons = backend_cls.supports(spec, platform)
        if reasons or (invariant and not backend_cls.batch_invariant_capable):
            assert all(isinstance(r, str) and r for r in reasons)
            pytest.skip(f"{self.backend_name} does not support {kind}{' batch-invariant' * invariant}")
        tol = self.dtype_tolerances[dtype]
        for out, expected in run_two_calls(backend_cls(spec, platform), spec, BATCHES[batch], num_blocks=64):
            torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)

    @pytest.mark.parametrize("batch", ["prefill", "chunked-prefill", "mixed"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    def test_bidirectional(self, backend_cls, batch, dtype):
        """``AttentionSpec(causal=False)``: each row attends to its whole context (a prompt of
        an encoder model), GQA and a block size the lengths are not multiples of; a backend
        that cannot must refuse it with reasons."""
        spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=32, dtype=dtype, block_size=16, causal=False)
        platform = self.platform_cls()
        reasons = backend_cls.supports(spec, platform)
        if reasons:
            assert all(isinstance(r, str) and r for r in reasons)
            pytest.skip(f"{self.backend_name} refuses bidirectional attention: {reasons}")
        backend = backend_cls(spec, platform)
        tol = self.dtype_tolerances[dtype]
        for out, expected in run_two_calls(backend, spec, BATCHES[batch], num_blocks=64):
            torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)

    def test_reports_reasons_for_unsupported_heads(self, backend_cls):
        spec = AttentionSpec(num_heads=6, num_kv_heads=4, head_dim=32, dtype=torch.float32, block_size=16)
        reasons = backend_cls.supports(spec, self.platform_cls())
        assert reasons and all(isinstance(r, str) and r for r in reasons)
