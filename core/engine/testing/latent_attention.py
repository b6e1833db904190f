"""Latent attention contract: a backend reading the paged latent layout (MLA, interface v5)
against plain math on random paged inputs. Per token the cache holds one vector, the latent
and the rotated key part every head shares; the reference decompresses it into per-head keys
``[W_UK @ latent, k_rope]`` and values ``W_UV @ latent`` in float64 and attends causally
(:func:`engine.testing.attention.reference_attention`). As in the per-head kit: prefill, decode
and mixed batches, a later chunk after a cached prefix, several block sizes, lengths that are
not block multiples, blocks scattered in the pool, prefix-cached blocks another request wrote,
several layers through one step's metadata, another query scale, and a wide shape (more heads
than a kernel's tile, an odd count; a latent of whole SIMD vectors) over long ragged contexts;
call 1 writes each request's context through the backend itself, call 2 runs the batch under test
over it."""

from __future__ import annotations

import pytest
import torch

from engine.builtin.platforms import CpuPlatform
from engine.interfaces import AttentionSpec, LatentUpProjection, PagedLatent
from engine.interfaces.attention import backend_reasons, construct
from engine.plugins import load_plugins
from engine.testing.attention import (
    BATCHES,
    DTYPE_IDS,
    _on_device,
    _tables,
    paged_layout,
    prefix_sharing,
    reference_attention,
)

# DeepSeek-V2/V3's proportions, shrunk: latent 32, rotary 8, per head 16 without rotary and 16 of value
SHAPES = dict(heads=4, rank=32, rope=8, nope=16, value=16)
# more heads than a tile of 16 and an odd count; latent and rotary parts of whole 8- and 16-lane vectors
WIDE_SHAPES = dict(heads=19, rank=64, rope=16, nope=32, value=32)


def latent_spec(dtype, block_size: int, query_scale: float | None = None, shapes=SHAPES) -> AttentionSpec:
    """A latent layer's spec; ``shapes`` as :data:`SHAPES` (the value size is the nope size)."""
    s = shapes
    return AttentionSpec(
        num_heads=s["heads"],
        num_kv_heads=1,
        head_dim=s["nope"] + s["rope"],
        dtype=dtype,
        block_size=block_size,
        query_scale=query_scale,
        latent=PagedLatent(s["rank"], s["rope"]),
    )


def shapes_of(spec: AttentionSpec) -> dict[str, int]:
    """The sizes :func:`latent_spec` built ``spec`` from."""
    assert spec.latent is not None
    nope = spec.head_dim - spec.latent.rope_dim
    return dict(
        heads=spec.num_heads, rank=spec.latent.kv_lora_rank, rope=spec.latent.rope_dim, nope=nope, value=nope
    )


def random_up_projection(dtype, gen, shapes=SHAPES) -> LatentUpProjection:
    s = shapes
    scale = s["rank"] ** -0.5
    return LatentUpProjection(
        (torch.randn(s["heads"], s["nope"], s["rank"], generator=gen) * scale).to(dtype),
        (torch.randn(s["heads"], s["value"], s["rank"], generator=gen) * scale).to(dtype),
    )


def _sequence(length: int, dtype, gen, shapes=SHAPES) -> dict[str, torch.Tensor]:
    s = shapes
    sizes = {
        "q_nope": (length, s["heads"], s["nope"]),
        "q_rope": (length, s["heads"], s["rope"]),
        "latent": (length, s["rank"]),
        "k_rope": (length, s["rope"]),
    }
    return {name: torch.randn(*shape, generator=gen).to(dtype) for name, shape in sizes.items()}


def reference_latent_attention(seq: dict[str, torch.Tensor], a: int, b: int, up, scale: float):
    """Rows [a, b) of a sequence over its first b tokens, decompressed, in float64."""
    latent, heads = seq["latent"][:b].double(), up.key.shape[0]
    keys = torch.cat(
        [
            torch.einsum("sr,hnr->shn", latent, up.key.double()),
            seq["k_rope"][:b].double()[:, None].expand(-1, heads, -1),
        ],
        dim=-1,
    )
    values = torch.einsum("sr,hvr->shv", latent, up.value.double())
    queries = torch.cat([seq["q_nope"][a:b], seq["q_rope"][a:b]], dim=-1)
    return reference_attention(queries, keys, values, scale)


def run_latent_calls(backend, spec, requests, num_blocks: int, shares=None, num_layers: int = 1, seed=0):
    """As :func:`engine.testing.attention.run_two_calls` for a latent backend: call 1 writes
    each request's cached context (itself checked), call 2 attends the new rows; every layer its
    own cache, inputs and up-projection. -> [(output, expected)] per call and layer."""
    gen = torch.Generator().manual_seed(seed)
    bs, shares, device = spec.block_size, shares or {}, backend.platform.device
    tables, shapes = _tables(requests, shares, bs, num_blocks, gen), shapes_of(spec)
    caches = [
        torch.zeros(backend.kv_cache_shape(num_blocks), dtype=spec.cache_dtype, device=device)
        for _ in range(num_layers)
    ]
    layers = []
    for _ in range(num_layers):
        seqs = [_sequence(ctx + n, spec.dtype, gen, shapes) for ctx, n in requests]
        for i, (donor, shared) in shares.items():
            for name in ("latent", "k_rope"):
                seqs[i][name][: shared * bs] = seqs[donor][name][: shared * bs]
        layers.append((seqs, random_up_projection(spec.dtype, gen, shapes)))
    results = []
    for first in (True, False):
        written = [ctx - shares.get(i, (0, 0))[1] * bs if first else n for i, (ctx, n) in enumerate(requests)]
        active = [i for i, count in enumerate(written) if count]
        if not active:
            continue
        span = [
            (requests[i][0] - written[i], requests[i][0]) if first else (requests[i][0], sum(requests[i]))
            for i in active
        ]
        layout = _on_device(
            paged_layout([(a, b - a) for a, b in span], [tables[i] for i in active], bs), device
        )
        metadata = backend.build_metadata(layout)
        for cache, (seqs, up) in zip(caches, layers):
            inputs = {
                name: torch.cat([seqs[i][name][a:b] for (a, b), i in zip(span, active)]) for name in seqs[0]
            }
            on_device = LatentUpProjection(up.key.to(device), up.value.to(device))
            out = backend.forward_latent(
                *(inputs[n].to(device) for n in ("q_nope", "q_rope", "latent", "k_rope")),
                cache,
                metadata,
                on_device,
            )
            expected = torch.cat(
                [reference_latent_attention(seqs[i], a, b, up, spec.scale) for (a, b), i in zip(span, active)]
            )
            results.append((out.cpu(), expected))
    return results


class LatentAttentionContract:
    """Subclass with ``backend_name`` (a backend whose ``cache_layouts`` has ``paged-latent``)."""

    backend_name: str
    platform_cls = CpuPlatform
    dtype_tolerances = {torch.float32: 2e-4, torch.bfloat16: 3e-2}
    batches: tuple[str, ...] = tuple(sorted(BATCHES))
    block_sizes: tuple[int, ...] = (8, 16)
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)

    def pytest_generate_tests(self, metafunc):
        marked = {
            name.strip()
            for mark in metafunc.definition.iter_markers("parametrize")
            for name in (mark.args[0].split(",") if isinstance(mark.args[0], str) else mark.args[0])
        }
        values = {"batch": self.batches, "block_size": self.block_sizes, "dtype": self.dtypes}
        for name, params in values.items():
            if name in metafunc.fixturenames and name not in marked:
                metafunc.parametrize(name, params, ids=[DTYPE_IDS.get(p, str(p)) for p in params])

    def backend(self, spec: AttentionSpec):
        """The backend built for ``spec`` as the engine builds it; it must accept the spec."""
        platform, registry = self.platform_cls(), load_plugins()
        registration = registry.registration("attention_backends", self.backend_name)
        cls = self.variant(registration.load())
        handed, reasons = backend_reasons(cls, registration.api, spec, platform)
        assert not reasons, f"{self.backend_name} refuses a latent spec: {reasons}"
        return construct(cls, registration.api, handed, platform, registry)

    def variant(self, cls):
        """The class under test given the registered one; a subclass may return a variant of it
        (another kernel of the same backend)."""
        return cls

    def check(self, backend, spec: AttentionSpec, requests, **kwargs):
        tol = self.dtype_tolerances[spec.dtype]
        for out, expected in run_latent_calls(backend, spec, requests, num_blocks=64, **kwargs):
            assert out.shape == expected.shape
            torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)

    def test_matches_reference(self, batch, block_size, dtype):
        spec = latent_spec(dtype, block_size)
        self.check(self.backend(spec), spec, BATCHES[batch])

    @pytest.mark.parametrize("batch", ["decode", "mixed"])
    def test_layers_share_one_steps_metadata(self, batch, dtype):
        spec = latent_spec(dtype, 8)
        self.check(self.backend(spec), spec, BATCHES[batch], num_layers=3)

    def test_reused_blocks(self, block_size, dtype):
        spec = latent_spec(dtype, block_size)
        requests, shares = prefix_sharing(block_size)
        self.check(self.backend(spec), spec, requests, shares=shares, num_layers=2)

    @pytest.mark.parametrize("batch", ["mixed", "chunked-prefill"])
    def test_query_scale(self, batch, dtype):
        """Another query scale (YaRN's mscale² over √head_dim in DeepSeek)."""
        spec = latent_spec(dtype, 8, query_scale=0.3)
        self.check(self.backend(spec), spec, BATCHES[batch])

    @pytest.mark.parametrize("batch", ["decode-ragged", "long-later-chunk"])
    def test_wide_shape_over_long_contexts(self, batch, dtype):
        """:data:`WIDE_SHAPES`: a kernel tiling heads meets a partial tile, ragged contexts up to
        451 tokens over blocks scattered in the pool."""
        spec = latent_spec(dtype, 16, shapes=WIDE_SHAPES)
        self.check(self.backend(spec), spec, BATCHES[batch])

    def test_cache_is_one_vector_per_token(self):
        """The cache's bytes per token are the layout's: latent and rotary part, no per-head K/V."""
        spec = latent_spec(torch.float32, 16)
        backend = self.backend(spec)
        shape = backend.kv_cache_shape(3)
        assert shape[backend.block_dim] == 3
        numel = 1
        for size in shape:
            numel *= size
        assert numel == 3 * 16 * spec.latent.entry_dim
