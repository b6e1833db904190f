"""The ``gguf`` method's less common layouts, against plain math: fused shards of different
block types (as Q4_K_M files store v_proj in Q6_K beside Q4_K q/k), a float shard among
quantized ones, and vocabulary tables of a size the int4 packing does not take (padded to its
64-row tiles), with their packed rows readable and, as on a torch that packs differently, not."""

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from engine.builtin.platforms import CpuPlatform
from engine.interfaces import QuantContext
from engine.layers import Linear, VocabEmbedding
from engine.layers.group_affine import Int4Planes
from engine.testing import select_platform
from engine_quant_gguf.formats import GGUFBlocks
from engine_quant_gguf.method import GGUFLinearMethod, Stacked, VocabTable
from engine_quant_gguf.writer import quantize

IN = 256


def _method(platform=None):
    platform = platform or select_platform("cpu")
    return GGUFLinearMethod(QuantContext({"quant_method": "gguf"}, torch.float32, platform))


def _shard(rows, qtype, gen):
    weight = torch.randn(rows, IN, generator=gen) * 0.05
    if qtype is None:
        return weight, weight
    raw = quantize(weight.numpy(), qtype)
    return GGUFBlocks(torch.from_numpy(raw), qtype), torch.from_numpy(
        dequantize(raw, qtype).reshape(rows, IN)
    )


def _load(layer, shards):
    for index, (tensor, _) in enumerate(shards):
        layer.load_shard("weight", tensor, index)
    layer.process_weights_after_loading()
    return torch.cat([plain for _, plain in shards])


def test_fused_shards_of_different_types_run_per_shard():
    gen = torch.Generator().manual_seed(0)
    shards = [_shard(64, T.Q4_K, gen), _shard(32, T.Q4_K, gen), _shard(32, T.Q6_K, gen)]
    layer = Linear(IN, [64, 32, 32], False, _method(), torch.float32)
    plain = _load(layer, shards)
    assert isinstance(layer.kernel, Stacked)
    torch.testing.assert_close(layer.method.dequantize(layer), plain, atol=1e-6, rtol=1e-6)
    x = torch.randn(5, IN, generator=gen)
    torch.testing.assert_close(layer(x), F.linear(x, plain), atol=1e-4, rtol=1e-4)


def test_a_float_shard_beside_quantized_ones():
    gen = torch.Generator().manual_seed(1)
    shards = [_shard(64, T.Q8_0, gen), _shard(32, None, gen)]
    layer = Linear(IN, [64, 32], False, _method(), torch.float32)
    plain = _load(layer, shards)
    x = torch.randn(3, IN, generator=gen)
    torch.testing.assert_close(layer(x), F.linear(x, plain), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("readable", [True, False])
def test_vocabulary_table_of_an_odd_size(readable, monkeypatch):
    """On the plain CPU platform (no packed kernel of its own): int4pack planes or blocks."""
    import engine_quant_gguf.method as method_module

    monkeypatch.setattr(method_module, "packed_rows_readable", lambda: readable)
    gen = torch.Generator().manual_seed(2)
    table = VocabEmbedding(100, IN, _method(CpuPlatform()), torch.float32)
    plain = _load(table, [_shard(100, T.Q8_0, gen)])
    assert isinstance(table.kernel, Int4Planes if readable else VocabTable)
    ids = torch.tensor([0, 63, 64, 99])
    torch.testing.assert_close(table(ids), plain[ids], atol=1e-6, rtol=1e-6)
    hidden = torch.randn(2, IN, generator=gen)
    torch.testing.assert_close(table.logits(hidden), F.linear(hidden, plain), atol=1e-4, rtol=1e-4)


def test_vocabulary_table_on_the_platforms_packed_kernel():
    """Where the platform packs affine weights (cpu-native), one packed table serves lookups
    (exact) and the LM head (int8 activations: within 2 % of the exact logits)."""
    method = _method()
    gen = torch.Generator().manual_seed(3)
    table = VocabEmbedding(100, IN, method, torch.float32)
    plain = _load(table, [_shard(100, T.Q8_0, gen)])
    if isinstance(table.kernel, (Int4Planes, VocabTable)):
        pytest.skip(f"{method.ctx.platform.name} has no packed affine kernel")
    ids = torch.tensor([0, 63, 64, 99])
    torch.testing.assert_close(table(ids), plain[ids], atol=1e-6, rtol=1e-6)
    hidden = torch.randn(2, IN, generator=gen)
    expected = F.linear(hidden, plain)
    torch.testing.assert_close(
        table.logits(hidden), expected, atol=0.02 * expected.abs().max().item(), rtol=0
    )
