"""The quant-method conformance kit for FP8 checkpoints (per-tensor, per-channel, 128×128
blocks — real safetensors folders with the config a real checkpoint carries) and online FP8."""

import pytest
import torch

from engine.interfaces import QuantContext
from engine.testing.quant import QuantMethodContract, write_quantized_checkpoint
from engine_quant_fp8.checkpoint import dequantize, quantization_config, quantize
from engine_quant_fp8.method import Fp8LinearMethod


class FakeCpu:
    name, device_type = "cpu", "cpu"


class Fp8CheckpointContract(QuantMethodContract):
    method = "fp8"
    scheme: str
    quant_error = 0.04  # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of the value
    logprob_atol = 0.08

    @property
    def checkpoint_config(self):
        return quantization_config(self.scheme)

    def checkpoint_tensors(self, weight):
        tensors = quantize(weight, self.scheme)
        return list(tensors.items()), dequantize(tensors)

    def write_model(self, folder, hf_model, hf_folder):
        write_quantized_checkpoint(
            hf_folder, folder, lambda w: quantize(w, self.scheme), quantization_config(self.scheme)
        )
        return {"model": folder}

    def refusals(self):
        return [
            lambda: Fp8LinearMethod(
                QuantContext({"quant_method": "fp8", "fmt": "e5m2"}, torch.bfloat16, FakeCpu())
            ),
            lambda: Fp8LinearMethod(
                QuantContext({"quant_method": "fp8", "weight_block_size": [128]}, torch.bfloat16, FakeCpu())
            ),
        ]


class TestPerTensor(Fp8CheckpointContract):
    scheme = "tensor"


class TestPerChannel(Fp8CheckpointContract):
    scheme = "channel"


class TestBlock(Fp8CheckpointContract):
    scheme = "block"


class TestOnline(QuantMethodContract):
    method = "fp8"
    quant_error = reference_atol = 0.04  # online: the plain math is the float weight itself
    logprob_atol = 0.08


def test_engine_plugins_says_which_path_and_why():
    assert "dequantized at load" in Fp8LinearMethod.describe(FakeCpu())
    assert "no FP8 matmul" in Fp8LinearMethod.describe(FakeCpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_scaled_mm_path_on_cuda():  # run on a lent GPU; the CPU suite covers the dequantized path
    from engine.testing import select_platform

    platform = select_platform("cuda")
    method = Fp8LinearMethod(QuantContext(None, torch.bfloat16, platform))
    assert method.fast == (torch.cuda.get_device_capability() >= (8, 9))
