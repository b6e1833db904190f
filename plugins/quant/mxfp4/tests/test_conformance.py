"""The quant-method conformance kit for MXFP4 checkpoints (real safetensors folders)."""

import torch

from engine.interfaces import QuantContext
from engine.testing.quant import QuantMethodContract, write_quantized_checkpoint
from engine_quant_mxfp4.format import dequantize, quantize
from engine_quant_mxfp4.method import Mxfp4LinearMethod


class FakeCpu:
    name, device_type, device = "cpu", "cpu", torch.device("cpu")


class TestMxfp4(QuantMethodContract):
    method = "mxfp4"
    checkpoint_config = {"quant_method": "mxfp4"}
    quant_error = 0.2  # e2m1 steps near the top are 1/3 of a block maximum (half of it, plus rounding)
    reference_atol = 1e-6  # power-of-two scales: exact in bf16
    logprob_atol = 0.3

    def checkpoint_tensors(self, weight):
        tensors = quantize(weight)
        return list(tensors.items()), dequantize(tensors["weight_blocks"], tensors["weight_scales"])

    def write_model(self, folder, hf_model, hf_folder):
        write_quantized_checkpoint(hf_folder, folder, quantize, self.checkpoint_config)
        return {"model": folder}

    def refusals(self):
        return [lambda: Mxfp4LinearMethod(QuantContext(None, torch.bfloat16, FakeCpu()))]


def test_codes_follow_the_specification():
    blocks = torch.tensor(
        [[[0x10 | 0x0, 0x98] + [0x72] * 14]], dtype=torch.uint8
    )  # codes 0,1 | 8,9 | 2,7 ...
    values = dequantize(blocks, torch.tensor([[127]], dtype=torch.uint8))[0]
    assert values[:6].tolist() == [0.0, 0.5, -0.0, -0.5, 1.0, 6.0]
    doubled = dequantize(blocks, torch.tensor([[128]], dtype=torch.uint8))[0]
    torch.testing.assert_close(doubled, values * 2)
