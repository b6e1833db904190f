"""Attention backend contract: the backend against plain math on random paged inputs —
prefill, decode and mixed batches, a long later prefill chunk, GQA, several block sizes,
lengths that are not block multiples, blocks scattered in the pool; and the attention kinds a
spec may ask for (a sliding window, soft-capped logits, another query scale, attention sinks),
alone and together, where a window's out-of-reach blocks are the null block (as the KV cache manager
leaves them) holding garbage. As the engine runs a step: q, k and v are strided head views of
one fused projection, several layers (each with its own cache) run through one step's metadata,
and block tables may start with another request's blocks (prefix caching). The context a batch
attends over is written by the backend itself in an earlier call, so any cache layout passes
that reads back what it wrote through the slot mapping. A backend declaring ``chunk_invariant``
is held to it bit for bit (``test_chunk_invariant``). A backend listing quantized KV dtypes
(``kv_cache_dtypes``) is checked on each, with K and V scales far from 1 and from each other
(:data:`KV_SCALE`), against the reference attending over K/V quantized and dequantized the
way the contract stores them (:func:`engine.interfaces.quantize_kv`), within the activation
dtype's tolerance (``test_quantized_kv_cache``)."""

from __future__ import annotations

import attrs
import pytest
import torch

from engine.builtin.platforms import CpuPlatform
from engine.interfaces import (
    PAGED_LATENT,
    AttentionSpec,
    BatchLayout,
    KVScale,
    PagedLatent,
    dequantize_kv,
    quantize_kv,
)
from engine.interfaces.attention import backend_reasons, construct
from engine.plugins import load_plugins
from engine.runner.decode_inputs import DecodeInputs, pad_decode

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


# a layer's KV scales in the quantized-cache tests: ~N(0, 1) keys stored ×20, values ×0.5, so a
# backend reading stored values unscaled, or with the other tensor's scale, is far off
KV_SCALE = KVScale(k=0.05, v=2.0)
QUANTIZED_KV = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "float16": torch.float16}

# attention kinds beside the plain one: AttentionSpec fields. "scale" alone because beside a
# soft-cap a backend may serve it through explicit scores, leaving its fused kernel calls (SDPA,
# flash), which take 1/√head_dim unless handed a scale, unchecked.
KINDS = {
    "window": dict(sliding_window=12),
    "softcap": dict(logit_softcap=2.0),
    "scale": dict(query_scale=0.3),
    "window-softcap-scale": dict(sliding_window=7, logit_softcap=1.5, query_scale=0.3),
    # each head's learned sink logit in the softmax's denominator (gpt-oss), under a window: the
    # sink term is the same on every path, so one kind covers it (the window's paths as well)
    "window-sinks": dict(sliding_window=7, sinks=True),
}


def random_sinks(num_heads: int, gen: torch.Generator) -> torch.Tensor:
    """Sink logits [num_heads] float32 spread around the scores' range (some heads' sinks take
    most of the weight, others little), so a backend that drops or misplaces them is far off."""
    return torch.randn(num_heads, generator=gen) * 2.0


def reference_attention(
    q, keys, values, scale, sliding_window=None, logit_softcap=None, causal: bool = True, sinks=None
):
    """q [q, H, D] over a sequence's whole keys/values [L, Hkv, D]; causal, last q positions;
    each query sees the ``sliding_window`` keys ending at its own (None: all), logits
    soft-capped as cap · tanh(logits / cap); ``causal=False``: every row over the whole
    sequence (no window then); ``sinks`` [H]: head h's weights are exp(score) / (exp(sinks[h]) +
    Σ exp(score)) (None: no sinks)."""
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
    if sinks is None:
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    column = sinks.double()[:, None, None].expand(-1, n, 1)
    probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)


def _beyond_window(tables, requests, block_size: int, window: int | None):
    """The tables with each block wholly before every new query's window set to the null block."""
    if window is None:
        return tables
    return [
        [0 if (i + 1) * block_size <= ctx - window + 1 else b for i, b in enumerate(t)]
        for t, (ctx, _) in zip(tables, requests)
    ]


def paged_layout(spans, tables, block_size) -> BatchLayout:
    """The layout of one call: per request, ``count`` new tokens from position ``start``."""
    lens, seqs, slots = [], [], []
    for (start, count), blocks in zip(spans, tables):
        positions = torch.arange(start, start + count)
        slots.append(torch.tensor(blocks)[positions // block_size] * block_size + positions % block_size)
        lens.append(count)
        seqs.append(start + count)
    table = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t)
    return BatchLayout(
        query_start_loc=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32),
        seq_lens=torch.tensor(seqs, dtype=torch.int32),
        block_table=table,
        slot_mapping=torch.cat(slots).long(),
        query_lens=tuple(lens),
        seq_lens_host=tuple(seqs),
    )


def fused_projection_views(q, k, v, row_padding: int = 16):
    """q [T, H, D], k and v [T, Hkv, D] as a model hands them over: head views into one fused
    q|k|v matmul output [T, (H + 2·Hkv)·D + row_padding] — neither of them contiguous, rows
    further apart than their heads, padding NaN (a backend that reads it fails)."""
    tokens, widths = q.shape[0], [t.shape[1] * t.shape[2] for t in (q, k, v)]
    fused = torch.full((tokens, sum(widths) + row_padding), float("nan"), dtype=q.dtype, device=q.device)
    parts = fused[:, : sum(widths)].split(widths, dim=1)
    return tuple(part.view(t.shape).copy_(t) for part, t in zip(parts, (q, k, v)))


def _tables(requests, shares, block_size: int, num_blocks: int, gen) -> list[list[int]]:
    """Each request's blocks drawn at random from the pool (never consecutive by design);
    a request in ``shares`` (request -> (donor, blocks)) starts with its donor's first blocks,
    as prefix caching hands them over."""
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables: list[list[int]] = []
    for i, (ctx, n) in enumerate(requests):
        donor, shared = shares.get(i, (None, 0))
        own = [free.pop() for _ in range(-(-(ctx + n) // block_size) - shared)]
        tables.append((tables[donor][:shared] if shared else []) + own)
    return tables


def _sequences(requests, shares, spec: AttentionSpec, block_size: int, gen):
    """Per request its q, k, v over the whole sequence; a sharer's K/V over its shared blocks are
    its donor's (the same tokens)."""
    seqs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for i, (ctx, n) in enumerate(requests):
        q, k, v = (
            torch.randn(ctx + n, h, spec.head_dim, generator=gen).to(spec.dtype)
            for h in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads)
        )
        if i in shares:
            donor, shared = shares[i]
            tokens = shared * block_size
            assert ctx == tokens, "a sharer's whole cached context is its donor's blocks"
            k[:tokens], v[:tokens] = seqs[donor][1][:tokens], seqs[donor][2][:tokens]
        seqs.append((q, k, v))
    return seqs


def run_two_calls(
    backend,
    spec: AttentionSpec,
    requests,
    num_blocks: int,
    seed: int = 0,
    num_layers: int = 1,
    shares: dict[int, tuple[int, int]] | None = None,
    device: torch.device | str = "cpu",
    graph: bool = False,
    kv_scale: KVScale = KV_SCALE,
):
    """Call 1 writes every request's context (a prefill, itself checked); call 2 runs the
    batch under test over it. Blocks are scattered over the pool; ``shares`` (request ->
    (donor, blocks)) makes a request's cached context its donor's first blocks, written once
    by the donor. q, k and v are strided views of one fused projection
    (:func:`fused_projection_views`). Each call builds its metadata once and runs
    ``num_layers`` layers through it, each over its own cache and inputs, as the engine does.
    The cache layout is the backend's own: only outputs are compared. Inputs, caches and the
    layout live on ``device``; outputs come back to the CPU. ``graph``: call 2 (a decode batch)
    runs through metadata built by ``build_graph_metadata`` over static buffers holding padding,
    which are overwritten in place with the batch afterwards, as a recorded step's are. With a
    quantized cache (``spec.kv_cache_dtype``) each forward gets ``kv_scale=`` and the reference
    attends over K/V as the cache holds them (:func:`_as_stored`).
    -> [(output, expected)] per call and layer."""
    gen = torch.Generator().manual_seed(seed)
    bs, shares = spec.block_size, shares or {}
    caches = [
        torch.zeros(backend.kv_cache_shape(num_blocks), dtype=spec.cache_dtype, device=device)
        for _ in range(num_layers)
    ]
    tables = _tables(requests, shares, bs, num_blocks, gen)
    layers = [_sequences(requests, shares, spec, bs, gen) for _ in range(num_layers)]
    sinks = [random_sinks(spec.num_heads, gen) if spec.sinks else None for _ in range(num_layers)]
    scaled = {"kv_scale": kv_scale} if spec.kv_cache_dtype is not None else {}
    results = []
    for first in (True, False):
        written = [ctx - shares.get(i, (0, 0))[1] * bs if first else n for i, (ctx, n) in enumerate(requests)]
        if not any(written):
            continue
        if not first and spec.sliding_window is not None:
            for cache in caches:
                null = cache.select(backend.block_dim, 0)
                null.copy_(torch.randn(null.shape, generator=gen).to(device))
        window_tables = tables if first else _beyond_window(tables, requests, bs, spec.sliding_window)
        active = [i for i, count in enumerate(written) if count]
        span = [
            (requests[i][0] - written[i], requests[i][0]) if first else (requests[i][0], sum(requests[i]))
            for i in active
        ]
        layout = _on_device(
            paged_layout([(a, b - a) for a, b in span], [window_tables[i] for i in active], bs), device
        )
        metadata = _graph_metadata(backend, layout) if graph and not first else backend.build_metadata(layout)
        for cache, seqs, layer_sinks in zip(caches, layers, sinks):
            q, k, v = (
                torch.cat([seqs[i][part][a:b] for (a, b), i in zip(span, active)]) for part in range(3)
            )
            extra = scaled if layer_sinks is None else {**scaled, "sinks": layer_sinks.to(device)}
            out = backend.forward(
                *fused_projection_views(q.to(device), k.to(device), v.to(device)), cache, metadata, **extra
            )
            expected = torch.cat(
                [
                    reference_attention(
                        seqs[i][0][a:b],
                        _as_stored(seqs[i][1][:b], spec, kv_scale.k),
                        _as_stored(seqs[i][2][:b], spec, kv_scale.v),
                        spec.scale,
                        spec.sliding_window,
                        spec.logit_softcap,
                        spec.causal,
                        layer_sinks,
                    )
                    for (a, b), i in zip(span, active)
                ]
            )
            results.append((out.cpu(), expected))
    return results


def _as_stored(x: torch.Tensor, spec: AttentionSpec, scale: float) -> torch.Tensor:
    """Keys or values as a quantized cache gives them back (in float64); as they are otherwise."""
    if spec.kv_cache_dtype is None:
        return x
    return dequantize_kv(quantize_kv(x, spec.kv_cache_dtype, scale), torch.float64, scale)


def _graph_metadata(backend, layout: BatchLayout):
    """Metadata built over static buffers of the layout's shape (one spare block column) while
    they hold padding, then the buffers overwritten with ``layout``."""
    size, device = layout.num_requests, layout.block_table.device
    max_blocks = layout.block_table.shape[1] + 1
    static = DecodeInputs.empty(size, max_blocks, device)
    metadata = backend.build_graph_metadata(static.layout)
    zeros = torch.zeros(size, dtype=torch.int64, device=device)
    static.copy_(pad_decode(zeros, zeros, layout, size, max_blocks))
    return metadata


def _on_device(layout: BatchLayout, device) -> BatchLayout:
    return attrs.evolve(
        layout,
        **{
            field: getattr(layout, field).to(device)
            for field in ("query_start_loc", "seq_lens", "block_table", "slot_mapping")
        },
    )


# How one prompt of CHUNKED_LEN tokens reaches the backend, for ``chunk_invariant``: per call,
# the (request, first position, rows) it attends. Request 0 is the prompt; 1 is another request
# whose prompt starts with the same PREFIX_BLOCKS blocks of tokens (its K/V); 2 has nothing in
# common. "prefix-cached": the prompt's table starts with request 1's blocks, which request 1
# wrote (a prefix-cache hit), and only its rows after them are attended.
CHUNKED_LEN, PREFIX_BLOCKS = 70, 2
CHUNKINGS = {
    "whole": [[(0, 0, 70)]],
    "odd-chunks": [[(0, 0, 3)], [(0, 3, 17)], [(0, 20, 29)], [(0, 49, 21)]],
    "decode-rows": [[(0, 0, 40)], *[[(0, p, 1)] for p in range(40, 46)], [(0, 46, 24)]],
    "beside-others": [[(2, 0, 9), (0, 0, 30)], [(0, 30, 40), (2, 9, 1)]],
    "prefix-cached": [[(1, 0, 37)], [(0, "prefix", 70)]],
}


def _chunking_sequences(spec: AttentionSpec, gen):
    """q, k, v [tokens, heads, D] of requests 0-2 of :data:`CHUNKINGS`; request 1's first
    PREFIX_BLOCKS blocks of tokens are request 0's."""
    lengths = (CHUNKED_LEN, 37, 10)
    seqs = [
        [
            torch.randn(n, h, spec.head_dim, generator=gen).to(spec.dtype)
            for h in (spec.num_heads, *[spec.num_kv_heads] * 2)
        ]
        for n in lengths
    ]
    shared = PREFIX_BLOCKS * spec.block_size
    for part in range(3):
        seqs[1][part][:shared] = seqs[0][part][:shared]
    return seqs


def attend_in_chunks(backend, spec: AttentionSpec, calls, seed: int = 0) -> dict[int, torch.Tensor]:
    """Request 0's output rows {position: [H, D]} when :data:`CHUNKINGS`' ``calls`` bring its
    prompt to ``backend``, each call building its metadata and attending in a fresh cache
    shared by the calls; a start of "prefix" is the first position after request 1's shared
    blocks, through a table that starts with them."""
    gen = torch.Generator().manual_seed(seed)
    device, bs = backend.platform.device, spec.block_size
    seqs = _chunking_sequences(spec, gen)
    free = (torch.randperm(63, generator=gen) + 1).tolist()
    own = [[free.pop() for _ in range(-(-len(seq[0]) // bs))] for seq in seqs]
    cached_table = own[1][:PREFIX_BLOCKS] + own[0][PREFIX_BLOCKS:]
    cache = torch.zeros(backend.kv_cache_shape(64), dtype=spec.cache_dtype, device=device)
    rows: dict[int, torch.Tensor] = {}
    for call in calls:
        spans, tables = [], []
        for request, start, count in call:
            cached = start == "prefix"
            first = PREFIX_BLOCKS * bs if cached else start
            spans.append((request, first, (count - first) if cached else count))
            tables.append(cached_table if cached else own[request])
        layout = _on_device(paged_layout([(a, n) for _, a, n in spans], tables, bs), device)
        q, k, v = (torch.cat([seqs[r][part][a : a + n] for r, a, n in spans]).to(device) for part in range(3))
        out = backend.forward(*fused_projection_views(q, k, v), cache, backend.build_metadata(layout)).cpu()
        offset = 0
        for request, first, count in spans:
            if request == 0:
                rows.update({first + i: out[offset + i] for i in range(count)})
            offset += count
    return rows


DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def prefix_sharing(block_size: int):
    """A batch whose requests reuse blocks (prefix caching): request 0 has cached 2 blocks and
    5 tokens; request 1's whole cached context is request 0's first 2 blocks, request 3's its
    first block; request 2 shares nothing. -> (requests, shares)."""
    requests = [(2 * block_size + 5, 1), (2 * block_size, 6), (3, 1), (block_size, 1)]
    return requests, {1: (0, 2), 3: (0, 1)}


class AttentionBackendContract:
    """Subclass with ``backend_name``. The parameters below are what the tests cover; a backend
    whose kernel is slow where the kit runs (an interpreted GPU kernel) may narrow them, and one
    with other block sizes may change ``block_sizes``."""

    backend_name: str
    platform_cls = CpuPlatform
    dtype_tolerances = {torch.float32: 2e-4, torch.bfloat16: 3e-2}
    batches: tuple[str, ...] = tuple(sorted(BATCHES))
    kinds: tuple[str, ...] = tuple(sorted(KINDS))
    block_sizes: tuple[int, ...] = (8, 16)
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)

    def pytest_generate_tests(self, metafunc):
        """Parametrizes ``batch``, ``kind``, ``block_size`` and ``dtype`` from the class's
        attributes, where a test's own marks do not."""
        marked = {
            name.strip()
            for mark in metafunc.definition.iter_markers("parametrize")
            for name in (mark.args[0].split(",") if isinstance(mark.args[0], str) else mark.args[0])
        }
        values = {
            "batch": self.batches,
            "kind": self.kinds,
            "block_size": self.block_sizes,
            "dtype": self.dtypes,
        }
        for name, params in values.items():
            if name in metafunc.fixturenames and name not in marked:
                metafunc.parametrize(name, params, ids=[DTYPE_IDS.get(p, str(p)) for p in params])

    @pytest.fixture
    def backend_cls(self):
        return load_plugins().get("attention_backends", self.backend_name)

    def _check(self, backend, spec: AttentionSpec, requests, **kwargs):
        tol = self.dtype_tolerances[spec.dtype]
        for out, expected in run_two_calls(
            backend, spec, requests, num_blocks=64, device=backend.platform.device, **kwargs
        ):
            assert out.shape == expected.shape
            torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)

    def _backend(self, backend_cls, spec: AttentionSpec):
        """The backend built for ``spec`` as the engine builds it, or the test skipped with the
        reasons the engine would not choose it: its ``supports``, or a spec its interface
        version predates (never handed to it: a v1 backend knows no sliding window)."""
        platform, registry = self.platform_cls(), load_plugins()
        api = registry.registration("attention_backends", self.backend_name).api
        handed, reasons = backend_reasons(backend_cls, api, spec, platform)
        if reasons:
            assert all(isinstance(r, str) and r for r in reasons)
            pytest.skip(f"{self.backend_name} does not support {spec}: {reasons}")
        return construct(backend_cls, api, handed, platform, registry)

    @pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
    def test_matches_reference(self, backend_cls, batch, heads, block_size, dtype):
        spec = AttentionSpec(
            num_heads=heads[0], num_kv_heads=heads[1], head_dim=32, dtype=dtype, block_size=block_size
        )
        self._check(self._backend(backend_cls, spec), spec, BATCHES[batch])

    @pytest.mark.parametrize("batch", ["decode", "mixed"])
    def test_layers_share_one_steps_metadata(self, backend_cls, batch, block_size, dtype):
        """Metadata built once per call and used by three layers, each with its own cache and
        inputs (as the engine runs a step): what a backend keeps between layers of a step must
        be keyed on the layer's cache, not on the metadata."""
        spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=32, dtype=dtype, block_size=block_size)
        self._check(self._backend(backend_cls, spec), spec, BATCHES[batch], num_layers=3)

    def test_reused_blocks(self, backend_cls, block_size, dtype):
        """Requests whose block tables start with another request's blocks (a prefix-cache hit),
        beside one that shares nothing, every table scattered over the pool."""
        spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=32, dtype=dtype, block_size=block_size)
        requests, shares = prefix_sharing(block_size)
        self._check(self._backend(backend_cls, spec), spec, requests, shares=shares, num_layers=2)

    def test_graph_metadata_reads_the_buffers_when_it_runs(self, backend_cls, batch, block_size, dtype):
        """A backend declaring ``cuda_graph_support``: metadata from ``build_graph_metadata``
        over static buffers that held padding when it was built, then were overwritten with a
        decode batch in place (as before a replay), attends that batch right, two layers deep."""
        if backend_cls.cuda_graph_support == "none":
            pytest.skip(f"{self.backend_name} declares cuda_graph_support 'none'")
        if any(n != 1 for _, n in BATCHES[batch]):
            pytest.skip("graphs record decode batches only")
        spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=32, dtype=dtype, block_size=block_size)
        self._check(self._backend(backend_cls, spec), spec, BATCHES[batch], num_layers=2, graph=True)

    @pytest.mark.parametrize("invariant", [False, True], ids=["batched", "batch-invariant"])
    def test_attention_kinds_match_reference(self, backend_cls, batch, kind, invariant, dtype):
        """Grouped-query heads, the smallest block size; a backend that does not support the kind says so."""
        spec = AttentionSpec(
            num_heads=8,
            num_kv_heads=2,
            head_dim=32,
            dtype=dtype,
            block_size=min(self.block_sizes),
            batch_invariant=invariant,
            **KINDS[kind],
        )
        if invariant and not backend_cls.batch_invariant_capable:
            pytest.skip(f"{self.backend_name} has no batch-invariant mode")
        self._check(self._backend(backend_cls, spec), spec, BATCHES[batch])

    @pytest.mark.parametrize("batch", ["prefill", "chunked-prefill", "mixed"])
    def test_bidirectional(self, backend_cls, batch, dtype):
        """``AttentionSpec(causal=False)``: each row attends to its whole context (a prompt of
        an encoder model), GQA and a block size the lengths are not multiples of; a backend
        that cannot must refuse it with reasons."""
        spec = AttentionSpec(
            num_heads=8, num_kv_heads=2, head_dim=32, dtype=dtype, block_size=16, causal=False
        )
        self._check(self._backend(backend_cls, spec), spec, BATCHES[batch])

    def test_chunk_invariant(self, backend_cls, block_size, dtype):
        """A backend declaring ``chunk_invariant``: each row of a prompt bit for bit the same
        whether the prompt comes whole, in chunks of other starts and lengths, with decode rows
        among them, beside other requests, or after a prefix another request wrote
        (:data:`CHUNKINGS`)."""
        if not backend_cls.chunk_invariant:
            pytest.skip(f"{self.backend_name} does not declare chunk_invariant")
        spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=32, dtype=dtype, block_size=block_size)
        backend = self._backend(backend_cls, spec)
        whole = attend_in_chunks(backend, spec, CHUNKINGS["whole"])
        for name, calls in CHUNKINGS.items():
            rows = attend_in_chunks(backend, spec, calls)
            differ = [p for p, row in sorted(rows.items()) if not torch.equal(row, whole[p])]
            assert not differ, f"{name}: rows {differ} differ from the whole prompt's"

    @pytest.mark.parametrize("kv_dtype", sorted(QUANTIZED_KV))
    @pytest.mark.parametrize("batch", ["prefill", "decode", "mixed", "long-later-chunk", "reused-blocks"])
    def test_quantized_kv_cache(self, backend_cls, batch, kv_dtype, dtype):
        """A quantized KV cache the backend declares it reads (``kv_cache_dtypes``; skipped for
        one it does not): K/V stored with the layer's scales and read back through them, on
        prefill, decode, a mixed batch, a long later chunk and prefix-cached blocks, two layers
        deep; a backend that reads none must refuse the spec with a reason."""
        spec = AttentionSpec(
            num_heads=8,
            num_kv_heads=2,
            head_dim=32,
            dtype=dtype,
            block_size=min(self.block_sizes),
            kv_cache_dtype=QUANTIZED_KV[kv_dtype],
        )
        if spec.kv_cache_dtype not in backend_cls.kv_cache_dtypes:
            api = load_plugins().registration("attention_backends", self.backend_name).api
            platform = self.platform_cls()
            assert any("KV cache" in r for r in backend_reasons(backend_cls, api, spec, platform)[1])
            pytest.skip(f"{self.backend_name} does not read a {kv_dtype} KV cache")
        backend = self._backend(backend_cls, spec)
        if batch == "reused-blocks":
            requests, shares = prefix_sharing(spec.block_size)
            self._check(backend, spec, requests, shares=shares, num_layers=2)
        else:
            self._check(backend, spec, BATCHES[batch], num_layers=2)

    def test_refuses_a_layout_it_does_not_read(self, backend_cls):
        """A backend not listing the paged latent layout (MLA) in ``cache_layouts`` is never
        handed a latent spec, and the reason names the layout (latent backends:
        :mod:`engine.testing.latent_attention`)."""
        if PAGED_LATENT in backend_cls.cache_layouts:
            pytest.skip(f"{self.backend_name} reads the paged latent layout")
        spec = AttentionSpec(
            num_heads=8,
            num_kv_heads=1,
            head_dim=24,
            dtype=torch.float32,
            block_size=16,
            latent=PagedLatent(32, 8),
        )
        api = load_plugins().registration("attention_backends", self.backend_name).api
        reasons = backend_reasons(backend_cls, api, spec, self.platform_cls())[1]
        assert any(PAGED_LATENT in r or "paged latent" in r for r in reasons), reasons

    def test_reports_reasons_for_unsupported_heads(self, backend_cls):
        spec = AttentionSpec(num_heads=6, num_kv_heads=4, head_dim=32, dtype=torch.float32, block_size=16)
        reasons = backend_cls.supports(spec, self.platform_cls())
        assert reasons and all(isinstance(r, str) and r for r in reasons)
