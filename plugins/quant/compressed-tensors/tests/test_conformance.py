"""The quant-method conformance kit for compressed-tensors checkpoints: real safetensors folders
written as the library writes them (:mod:`engine_quant_compressed_tensors.checkpoint`), one
class per scheme. The kit's layer checks run on the plain ``cpu`` platform (NVFP4's on
``cpu-native``, its FP4 kernel); its model check on the best platform here."""

import pytest
import torch

from engine.interfaces import QuantContext
from engine.layers import Linear
from engine.testing import select_platform
from engine.testing.quant import QuantMethodContract, write_quantized_checkpoint
from engine_quant_compressed_tensors import checkpoint
from engine_quant_compressed_tensors.kernels import fp4_probe
from engine_quant_compressed_tensors.method import CompressedTensorsLinearMethod


class FakeCpu:
    name, device_type, device = "cpu", "cpu", torch.device("cpu")


def _method(config):
    return lambda: CompressedTensorsLinearMethod(QuantContext(config, torch.bfloat16, FakeCpu()))


def _with_group(config: dict, **changes) -> dict:
    return config | {"config_groups": {"group_0": config["config_groups"]["group_0"] | changes}}


def _with_weights(config: dict, **changes) -> dict:
    return _with_group(config, weights=config["config_groups"]["group_0"]["weights"] | changes)


class CompressedTensorsContract(QuantMethodContract):
    method = "compressed-tensors"
    quant_error = 0.15  # 4 bits: half a step is 1/15 of a group's largest magnitude
    logprob_atol = 0.3

    def quantize(self, weight: torch.Tensor) -> dict:
        raise NotImplementedError

    def dequantize_plain(self, tensors: dict) -> torch.Tensor:
        raise NotImplementedError

    def checkpoint_tensors(self, weight):
        tensors = self.quantize(weight)
        return list(tensors.items()), self.dequantize_plain(tensors)

    def write_model(self, folder, hf_model, hf_folder):
        write_quantized_checkpoint(hf_folder, folder, self.quantize, self.checkpoint_config)
        return {"model": folder}

    def refusals(self):
        base = self.checkpoint_config
        return [
            _method(None),
            _method(base | {"config_groups": {}}),
            _method(_with_group(base, format="marlin-24")),
            _method(_with_weights(base, num_bits="4")),
            _method(base | {"ignore": "lm_head"}),
        ]


class TestW4A16Group(CompressedTensorsContract):
    checkpoint_config = checkpoint.config("pack-quantized", checkpoint.int_weights(4, 32))

    def quantize(self, weight):
        return checkpoint.packed_tensors(weight, 4, 32)

    def dequantize_plain(self, tensors):
        return checkpoint.dequantize_packed(tensors, 4)

    def refusals(self):
        def group_96():
            method = _method(_with_weights(self.checkpoint_config, group_size=96))()
            method.create_weights(torch.nn.Module(), 256, [64])

        return [*super().refusals(), _method(_with_weights(self.checkpoint_config, num_bits=3)), group_96]


class TestW8A16AsymmetricChannel(CompressedTensorsContract):
    checkpoint_config = checkpoint.config("pack-quantized", checkpoint.int_weights(8, None, symmetric=False))
    quant_error = 0.01  # half a step is 1/255 of a row's range
    logprob_atol = 0.05

    def quantize(self, weight):
        return checkpoint.packed_tensors(weight, 8, None, symmetric=False)

    def dequantize_plain(self, tensors):
        return checkpoint.dequantize_packed(tensors, 8)


class TestW8A8Dynamic(CompressedTensorsContract):
    checkpoint_config = checkpoint.config(
        "int-quantized", checkpoint.int_weights(8, None), checkpoint.activations("int", dynamic=True)
    )
    quant_error = 0.01
    logprob_atol = 0.05

    def quantize(self, weight):
        return checkpoint.int8_tensors(weight)

    def dequantize_plain(self, tensors):
        return checkpoint.dequantize_int8(tensors)


class TestW8A8Static(TestW8A8Dynamic):
    checkpoint_config = checkpoint.config(
        "int-quantized", checkpoint.int_weights(8, None), checkpoint.activations("int", dynamic=False)
    )
    apply_rtol = 3e-2  # activations rounded on one static grid (x within ±4, steps of 1/32)

    def quantize(self, weight):
        return checkpoint.int8_tensors(weight, input_scale=4 / 127)

    # Experts with static input scales are refused (as vLLM refuses them): the kit's two
    # expert checks are that refusal here.
    def test_moe_experts_dequantize_to_the_format(self, registry, platform):
        self._experts_refused(registry, platform)

    def test_moe_layer_matches_the_per_expert_reference(self, registry, platform):
        self._experts_refused(registry, platform)

    def _experts_refused(self, registry, platform):
        from engine.testing.moe import loaded_moe

        with pytest.raises(ValueError, match="experts of a mixture-of-experts layer with static input"):
            loaded_moe(self.make_method(registry, platform), 4, 2, 64, 64, True, self.checkpoint_tensors)


class TestFp8Block(CompressedTensorsContract):
    checkpoint_config = checkpoint.config(
        "float-quantized", checkpoint.float_weights("block"), checkpoint.activations("float", dynamic=True)
    )
    quant_error = 0.07  # e4m3: 3 mantissa bits
    logprob_atol = 0.1

    def quantize(self, weight):
        return checkpoint.fp8_tensors(weight, "block")

    def dequantize_plain(self, tensors):
        return checkpoint.dequantize_fp8(tensors, "block")


class TestNvfp4(CompressedTensorsContract):
    checkpoint_config = checkpoint.config("nvfp4-pack-quantized", checkpoint.NVFP4_WEIGHTS)
    quant_error = 0.2  # e2m1 around 6: steps of 2, a third of the block's largest magnitude
    logprob_atol = 0.4

    @pytest.fixture(scope="class")
    @classmethod
    def platform(cls, registry):
        """cpu-native: the layer checks run the FP4 kernel (``fp4_probe`` says it is offered)."""
        platform = select_platform("cpu-native")
        assert fp4_probe(platform) == "fp4"
        return platform

    def quantize(self, weight):
        return checkpoint.nvfp4_tensors(weight)

    def dequantize_plain(self, tensors):
        return checkpoint.dequantize_nvfp4(tensors)

    def refusals(self):
        return [*super().refusals(), _method(_with_weights(self.checkpoint_config, group_size=32))]


@pytest.mark.parametrize("contract", [TestW4A16Group, TestFp8Block, TestNvfp4])
def test_a_fused_layer_partly_left_float_is_joined_dequantized(contract):
    """q/k/v of which the checkpoint left one float (an ``ignore`` entry naming one projection):
    the layer holds the float shard as it is and the others dequantized by the format's math."""
    method = CompressedTensorsLinearMethod(
        QuantContext(contract.checkpoint_config, torch.float32, select_platform("cpu"))
    )
    layer = Linear(256, [96, 32, 32], False, method, torch.float32)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(rows, 256, generator=gen) * 0.05 for rows in (96, 32, 32)]
    represented = []
    for shard, weight in enumerate(weights):
        tensors, plain = (
            ([("weight", weight)], weight) if shard == 1 else contract().checkpoint_tensors(weight)
        )
        for name, tensor in tensors:
            layer.load_shard(name, tensor, shard)
        represented.append(plain.float())
    layer.process_weights_after_loading()
    torch.testing.assert_close(method.dequantize(layer), torch.cat(represented), atol=1e-6, rtol=1e-5)
