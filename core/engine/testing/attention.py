"""Attention backend contract: the backend against plain math on random paged inputs —
prefill, decode and mixed batches, GQA, several block sizes, lengths that are not block
multiples, blocks scattered in the pool."""

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
    "mixed": [(30, 1), (0, 19), (9, 1), (12, 6), (47, 1)],
}


def reference_attention(q, keys, values, scale):
    """q [q, H, D] over a sequence's whole keys/values [L, Hkv, D]; causal, last q positions."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).double()
    v = values.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    length, n = keys.shape[0], q.shape[0]
    allowed = torch.arange(length)[None, :] <= (length - n + torch.arange(n))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def make_batch(spec: AttentionSpec, requests, num_blocks: int, backend, seed: int = 0):
    """Random cache contents and a batch layout with blocks scattered over the pool."""
    gen = torch.Generator().manual_seed(seed)
    bs, hkv, d = spec.block_size, spec.num_kv_heads, spec.head_dim
    cache = torch.randn(backend.kv_cache_shape(num_blocks), generator=gen).to(spec.dtype)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, slots, seqs = [], [], []
    q_all, k_all, v_all = [], [], []
    for ctx, n in requests:
        blocks = [free.pop() for _ in range(-(-(ctx + n) // bs))]
        tables.append(blocks)
        positions = torch.arange(ctx, ctx + n)
        slots.append(torch.tensor(blocks)[positions // bs] * bs + positions % bs)
        q_all.append(torch.randn(n, spec.num_heads, d, generator=gen).to(spec.dtype))
        k_all.append(torch.randn(n, hkv, d, generator=gen).to(spec.dtype))
        v_all.append(torch.randn(n, hkv, d, generator=gen).to(spec.dtype))
        seqs.append(ctx + n)
    width = max(len(t) for t in tables)
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, :len(t)] = torch.tensor(t)
    lens = [n for _, n in requests]
    layout = BatchLayout(
        query_start_loc=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32),
        seq_lens=torch.tensor(seqs, dtype=torch.int32), block_table=table,
        slot_mapping=torch.cat(slots).long(), query_lens=tuple(lens), seq_lens_host=tuple(seqs))
    return cache, layout, torch.cat(q_all), torch.cat(k_all), torch.cat(v_all), tables


def expected_output(spec, cache, layout, q, k, v, tables, requests):
    """Plain math: write the new K/V into a copy of the cache, then attend per request."""
    bs = spec.block_size
    key_cache, value_cache = cache[0].clone(), cache[1].clone()
    key_cache.view(-1, spec.num_kv_heads, spec.head_dim)[layout.slot_mapping] = k
    value_cache.view(-1, spec.num_kv_heads, spec.head_dim)[layout.slot_mapping] = v
    outs, start = [], 0
    for (ctx, n), blocks in zip(requests, tables):
        length = ctx + n
        keys = key_cache[blocks].flatten(0, 1)[:length]
        values = value_cache[blocks].flatten(0, 1)[:length]
        outs.append(reference_attention(q[start:start + n], keys, values, spec.scale))
        start += n
    return torch.cat(outs), key_cache, value_cache


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
        requests = BATCHES[batch]
        cache, layout, q, k, v, tables = make_batch(spec, requests, num_blocks=64, backend=backend)
        expected, key_cache, value_cache = expected_output(spec, cache, layout, q, k, v, tables, requests)
        out = backend.forward(q, k, v, cache, backend.build_metadata(layout))
        assert out.shape == q.shape
        torch.testing.assert_close(out.double(), expected, atol=self.dtype_tolerances[dtype],
                                   rtol=self.dtype_tolerances[dtype])
        assert torch.equal(cache[0], key_cache) and torch.equal(cache[1], value_cache), \
            "the backend must write this step's K/V through the slot mapping"

    def test_reports_reasons_for_unsupported_heads(self, backend_cls):
        spec = AttentionSpec(num_heads=6, num_kv_heads=4, head_dim=32, dtype=torch.float32, block_size=16)
        reasons = backend_cls.supports(spec, self.platform_cls())
        assert reasons and all(isinstance(r, str) and r for r in reasons)
