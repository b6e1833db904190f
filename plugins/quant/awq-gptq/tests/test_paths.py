"""Which kernel runs, and the fallbacks: ``describe`` names the path ``engine plugins`` prints;
a fused act-order layer whose shards order their inputs differently is dequantized at load
and still computes the checkpoint's weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.interfaces import QuantContext
from engine.layers import Linear
from engine.plugins import load_plugins
from engine.testing import select_platform
from engine_quant_awq_gptq import checkpoint
from engine_quant_awq_gptq.method import PATHS, AwqLinearMethod, GptqLinearMethod


def _gptq_layer(platform, group: int, orders: list[torch.Tensor | None]):
    """A fused [64 | 32, 256] GPTQ layer with each shard grouped in its own act order ->
    (layer, the weight its checkpoint tensors represent)."""
    config = checkpoint.gptq_config(4, group, sym=False, desc_act=True)
    method = GptqLinearMethod(QuantContext(config, torch.float32, platform))
    layer = Linear(256, [64, 32], False, method, torch.float32)
    gen = torch.Generator().manual_seed(0)
    represented = []
    for shard, (rows, order) in enumerate(zip((64, 32), orders)):
        tensors = checkpoint.gptq_tensors(
            torch.randn(rows, 256, generator=gen) * 0.05, 4, group, sym=False, desc_act=True, order=order
        )
        for name, tensor in tensors.items():
            layer.load_shard(name, tensor, shard)
        represented.append(checkpoint.dequantize_gptq(tensors, 4))
    layer.process_weights_after_loading()
    return layer, torch.cat(represented)


def _matches(layer, represented):
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(layer.method.dequantize(layer), represented, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(x), F.linear(x, represented), atol=1e-4, rtol=1e-4)


def test_shards_in_one_act_order_share_the_kernel_and_reorder_activations():
    order = torch.randperm(256, generator=torch.Generator().manual_seed(2))
    layer, represented = _gptq_layer(select_platform("cpu"), 64, [order, order])
    assert layer.kernel_path == "int4pack" and layer.input_order is not None
    _matches(layer, represented)


def test_shards_in_different_act_orders_are_dequantized_at_load():
    gen = torch.Generator().manual_seed(3)
    layer, represented = _gptq_layer(select_platform("cpu"), 64, [torch.randperm(256, generator=gen), None])
    assert layer.kernel_path == "dense"
    _matches(layer, represented)


def test_group_sizes_no_kernel_holds_are_dequantized_at_load():
    layer, represented = _gptq_layer(select_platform("cpu"), 16, [None, None])
    assert layer.kernel_path == "dense"
    _matches(layer, represented)


def test_engine_plugins_names_the_path_a_layer_takes():
    """On every platform here, what ``describe`` prints is the path a 4-bit group-32 layer takes."""
    registry = load_plugins(None)
    for name in registry.names("platforms"):
        try:
            platform = select_platform(name)
        except RuntimeError:  # unavailable here (e.g. cuda)
            continue
        method = AwqLinearMethod(QuantContext(checkpoint.awq_config(32), torch.bfloat16, platform))
        layer = Linear(256, [64], False, method, torch.bfloat16)
        for tensor_name, tensor in checkpoint.awq_tensors(torch.randn(64, 256), 32).items():
            layer.load_shard(tensor_name, tensor)
        layer.process_weights_after_loading()
        assert method.describe(platform).startswith(PATHS[layer.kernel_path]), name
        assert GptqLinearMethod.describe(platform) == method.describe(platform)


def test_symmetric_gptq_keeps_its_scales_alone_on_the_packed_kernel():
    """A symmetric checkpoint's offsets are all −8·s: a platform whose packed kernel makes them
    from the scales (cpu-native) keeps 18 bytes a group of 32, as GGUF's Q4_0, and computes the
    checkpoint's weight."""
    registry = load_plugins(None)
    if "cpu-native" not in registry.names("platforms"):
        pytest.skip("the cpu-native platform plugin is not installed")
    platform = select_platform("cpu-native")
    config = checkpoint.gptq_config(4, 32, sym=True, desc_act=False)
    method = GptqLinearMethod(QuantContext(config, torch.float32, platform))
    layer = Linear(256, [64], False, method, torch.float32)
    tensors = checkpoint.gptq_tensors(torch.randn(64, 256) * 0.05, 4, 32, sym=True, desc_act=False)
    for name, tensor in tensors.items():
        layer.load_shard(name, tensor)
    layer.process_weights_after_loading()
    assert layer.kernel_path == "packed"
    packed = layer.kernel
    assert (packed.qw.numel() + packed.sz.numel() * packed.sz.element_size()) * 32 / (64 * 256) == 18
    torch.testing.assert_close(packed.dequantize(), checkpoint.dequantize_gptq(tensors, 4), atol=1e-6, rtol=0)
