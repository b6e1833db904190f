"""The quant-method conformance kit for AWQ and GPTQ checkpoints: real safetensors folders
packed by the formats' reference loops (:mod:`engine_quant_awq_gptq.checkpoint`), one class per
variant — AWQ at each group size, GPTQ 4/8-bit, symmetric and not, act-order, v1 and v2 zeros.

The kit's layer checks run on the plain ``cpu`` platform (int4pack planes); its model check on
the best platform here (cpu-native's packed kernel where the CPU has VNNI)."""

import torch

from engine.interfaces import QuantContext
from engine.testing.quant import QuantMethodContract, write_quantized_checkpoint
from engine_quant_awq_gptq import checkpoint
from engine_quant_awq_gptq.method import AwqLinearMethod, GptqLinearMethod


class FakeCpu:
    name, device_type, device = "cpu", "cpu", torch.device("cpu")


def _method(cls, config):
    return lambda: cls(QuantContext(config, torch.bfloat16, FakeCpu()))


class AwqContract(QuantMethodContract):
    method = "awq"
    group: int
    quant_error = 0.15  # 4 bits over a group's range: half a step is 1/30 of it, ~1/8 of max |W|
    logprob_atol = 0.3

    @property
    def checkpoint_config(self):
        return checkpoint.awq_config(self.group)

    def checkpoint_tensors(self, weight):
        tensors = checkpoint.awq_tensors(weight, self.group)
        return list(tensors.items()), checkpoint.dequantize_awq(tensors, self.group)

    def write_model(self, folder, hf_model, hf_folder):
        write_quantized_checkpoint(
            hf_folder, folder, lambda w: checkpoint.awq_tensors(w, self.group), self.checkpoint_config
        )
        return {"model": folder}

    def refusals(self):
        base = checkpoint.awq_config(self.group)
        return [
            _method(AwqLinearMethod, None),
            _method(AwqLinearMethod, base | {"version": "gemv"}),
            _method(AwqLinearMethod, base | {"bits": 8}),
            _method(AwqLinearMethod, {"quant_method": "awq", "bits": 4}),
        ]


class TestAwqGroup32(AwqContract):
    group = 32


class TestAwqGroup64(AwqContract):
    group = 64


class TestAwqGroup128(AwqContract):
    group = 128


class GptqContract(QuantMethodContract):
    method = "gptq"
    bits, group, sym, desc_act, v2 = 4, 128, True, False, False
    quant_error = 0.15
    logprob_atol = 0.3

    @property
    def checkpoint_config(self):
        return checkpoint.gptq_config(self.bits, self.group, self.sym, self.desc_act, self.v2)

    def quantize(self, weight):
        return checkpoint.gptq_tensors(weight, self.bits, self.group, self.sym, self.desc_act, self.v2)

    def checkpoint_tensors(self, weight):
        tensors = self.quantize(weight)
        return list(tensors.items()), checkpoint.dequantize_gptq(tensors, self.bits, self.v2)

    def write_model(self, folder, hf_model, hf_folder):
        write_quantized_checkpoint(hf_folder, folder, self.quantize, self.checkpoint_config)
        return {"model": folder}

    def refusals(self):
        base = self.checkpoint_config
        return [
            _method(GptqLinearMethod, None),
            _method(GptqLinearMethod, base | {"bits": 3}),
            _method(GptqLinearMethod, base | {"checkpoint_format": "marlin"}),
            _method(GptqLinearMethod, {"quant_method": "gptq", "group_size": 128}),
        ]


class TestGptq4BitSymmetric(GptqContract):
    pass


class TestGptq4BitAsymmetricActOrderV1(GptqContract):
    group, sym, desc_act = 32, False, True


class TestGptq4BitAsymmetricV2(GptqContract):
    group, sym, v2 = 64, False, True


class TestGptq8BitActOrder(GptqContract):
    bits, group, desc_act = 8, 32, True
    quant_error = 0.01  # 8 bits: half a step is 1/510 of a group's range
    logprob_atol = 0.05
