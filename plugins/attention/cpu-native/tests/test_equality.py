"""cpu-native against the torch backend and plain math on the same random paged inputs:
bf16 and float32, GQA ratios 1, 3 and 4, head_dim 64, 80 (a last piece of 16 values) and 128,
contexts that are not block multiples, block tables shuffled over the pool; decode batches and
mixed prefill + decode, with the AVX-512 and the portable C kernels (every row in C, a prompt
in 16-row tiles)."""

import pytest
import torch

from engine.builtin.platforms import CpuPlatform
from engine.interfaces import AttentionSpec, KVScale, quantize_kv
from engine.plugins import load_plugins
from engine.testing.attention import run_two_calls
from engine_attention_cpu_native.backend import NativeAttentionBackend

BATCHES = {
    "decode": [(3, 1), (47, 1), (16, 1), (200, 1), (0, 1), (95, 1), (31, 1)],
    # chunks shorter and longer than a 16-row tile beside decode rows
    "mixed": [(70, 1), (0, 23), (9, 1), (40, 5), (0, 3), (130, 1), (21, 40)],
}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


class Portable(NativeAttentionBackend):
    portable = True


@pytest.mark.parametrize("kernel", [NativeAttentionBackend, Portable], ids=["avx512", "portable"])
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2)], ids=["g1", "g3", "g4"])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_the_torch_backend(kernel, batch, heads, head_dim, dtype):
    spec = AttentionSpec(
        num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim, dtype=dtype, block_size=16
    )
    platform = CpuPlatform()
    torch_backend = load_plugins().get("attention_backends", "torch")(spec, platform)
    ours = run_two_calls(
        kernel(spec, platform, registry=load_plugins()), spec, BATCHES[batch], num_blocks=128, seed=head_dim
    )
    theirs = run_two_calls(torch_backend, spec, BATCHES[batch], num_blocks=128, seed=head_dim)
    tol = TOLERANCE[dtype]
    for (out, expected), (reference_out, _) in zip(ours, theirs):
        assert out.dtype == dtype and out.shape == reference_out.shape
        torch.testing.assert_close(out.float(), reference_out.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "head_dim, dtype, reason",
    [
        (40, torch.float32, "head_dim 40 is not a multiple of 16"),
        (512, torch.bfloat16, "head_dim 512 is not a multiple of 16 up to 256"),
        (64, torch.float16, "takes bfloat16 and float32 caches"),
    ],
)
def test_says_why_not_so_torch_is_chosen(head_dim, dtype, reason):
    from engine.core.setup import select_attention_backend

    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=head_dim, dtype=dtype, block_size=16)
    reasons = NativeAttentionBackend.supports(spec, CpuPlatform())
    assert any(reason in r for r in reasons), reasons
    registry = load_plugins()
    platform = registry.get("platforms", "cpu-native")()
    assert select_attention_backend(registry, None, spec, platform).name == "torch"


def test_the_cpu_native_platform_prefers_it():
    from engine.core.setup import select_attention_backend

    spec = AttentionSpec(num_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16, block_size=16)
    registry = load_plugins()
    platform = registry.get("platforms", "cpu-native")()
    assert select_attention_backend(registry, None, spec, platform).name == "cpu-native"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_short_chunk_reads_a_prefix_written_in_the_same_step(dtype):
    """A prompt prefilled in the same step (40 rows, three tiles) as a short chunk
    in C whose first two blocks are that prompt's (a prefix shared within the step): the
    chunk must see the prompt's K/V, so every row is written before anything attends."""
    from engine.interfaces import BatchLayout
    from engine.testing.attention import reference_attention

    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype, block_size=16)
    backend = NativeAttentionBackend(spec, CpuPlatform(), registry=load_plugins())
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(45, h, 64, generator=gen).to(dtype) for h in (8, 2, 2))
    blocks_a, blocks_b = [5, 2, 9], [5, 2, 4]  # B shares A's first 32 tokens, then 5 of its own
    slots = [blocks_a[p // 16] * 16 + p % 16 for p in range(40)] + [
        blocks_b[2] * 16 + p % 16 for p in range(32, 37)
    ]
    layout = BatchLayout(
        query_start_loc=torch.tensor([0, 40, 45], dtype=torch.int32),
        seq_lens=torch.tensor([40, 37], dtype=torch.int32),
        block_table=torch.tensor([blocks_a, blocks_b], dtype=torch.int32),
        slot_mapping=torch.tensor(slots),
        query_lens=(40, 5),
        seq_lens_host=(40, 37),
    )
    cache = torch.full(backend.kv_cache_shape(16), float("nan"), dtype=dtype)
    out = backend.forward(q, k, v, cache, backend.build_metadata(layout))
    keys_b, values_b = torch.cat([k[:32], k[40:]]), torch.cat([v[:32], v[40:]])
    expected = torch.cat(
        [
            reference_attention(q[:40], k[:40], v[:40], spec.scale),
            reference_attention(q[40:], keys_b, values_b, spec.scale),
        ]
    )
    tol = TOLERANCE[dtype] * 2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_the_kv_write_equals_torch_index_copy(dtype, tokens):
    """The C scatter of a step's K/V (strided views of one q|k|v row, as the engine passes them)."""
    heads, kv_heads, dim, blocks, block_size = 6, 2, 64, 40, 16
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    _, key, value = qkv.view(tokens, -1, dim).split([heads, kv_heads, kv_heads], dim=1)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    expected = torch.zeros(2, kv_heads, blocks, block_size, dim, dtype=dtype)
    expected.view(2, kv_heads, -1, dim).index_copy_(2, slots, torch.stack([key, value]).transpose(1, 2))
    spec = AttentionSpec(heads, kv_heads, dim, dtype, block_size)
    backend = NativeAttentionBackend(spec, CpuPlatform(), registry=load_plugins())
    cache = torch.zeros_like(expected)
    backend._write_kv(key, value, cache, slots)
    assert torch.equal(cache, expected)
    with pytest.raises(IndexError, match="outside the cache"):
        backend._write_kv(key, value, cache, torch.full((tokens,), blocks * block_size))
    assert torch.equal(cache, expected)  # a bad slot writes nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "stored", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float16], ids=["e4m3", "e5m2", "f16"]
)
def test_the_fp8_kv_write_equals_quantize_kv(dtype, stored):
    """The C scatter into an fp8 (or float16) cache stores what the contract's ``quantize_kv``
    stores, bit for bit: each tensor divided by its own scale, subnormals, ties and outliers
    (saturated) included."""
    heads, kv_heads, dim, blocks, block_size, tokens = 6, 2, 64, 40, 16, 300
    gen = torch.Generator().manual_seed(7)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 30).to(dtype)
    qkv[0, heads * dim : heads * dim + 6] = torch.tensor([1e-4, -3e-3, 500.0, -1e5, 0.0, 3e-6]).to(dtype)
    _, key, value = qkv.view(tokens, -1, dim).split([heads, kv_heads, kv_heads], dim=1)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    scale = KVScale(k=0.3, v=7.0)
    spec = AttentionSpec(heads, kv_heads, dim, dtype, block_size, kv_cache_dtype=stored)
    backend = NativeAttentionBackend(spec, CpuPlatform(), registry=load_plugins())
    bits = torch.int16 if stored.itemsize == 2 else torch.uint8  # compared bit for bit
    expected = torch.zeros(backend.kv_cache_shape(blocks), dtype=bits)
    new_kv = torch.stack([quantize_kv(key, stored, scale.k), quantize_kv(value, stored, scale.v)])
    expected.view(2, kv_heads, -1, dim).index_copy_(2, slots, new_kv.view(bits).transpose(1, 2))
    cache = torch.zeros(backend.kv_cache_shape(blocks), dtype=stored)
    backend._write_kv(key, value, cache, slots, scale)
    assert torch.equal(cache.view(bits), expected)
    with pytest.raises(IndexError, match="outside the cache"):
        backend._write_kv(key, value, cache, torch.full((tokens,), blocks * block_size), scale)
    assert torch.equal(cache.view(bits), expected)  # a bad slot writes nothing
