"""The quant-method conformance kit for bitsandbytes checkpoints: each layer's tensors made by
bitsandbytes' own quantizers, a tiny model saved by transformers through ``BitsAndBytesConfig``."""

import pytest
import torch

from engine.interfaces import QuantContext
from engine.testing.quant import QuantMethodContract
from engine_quant_bitsandbytes.checkpoint import MODES, as_layer_parameters, quantized_tensors, save_quantized
from engine_quant_bitsandbytes.formats import tensor_name
from engine_quant_bitsandbytes.method import BitsAndBytesLinearMethod

pytest.importorskip("bitsandbytes", reason="bitsandbytes (the test extra) makes these tests' checkpoints")


class BitsAndBytesContract(QuantMethodContract):
    method = "bitsandbytes"
    mode: str
    quant_error = 0.2  # 4 bits: the widest gap of NF4's table is 0.30 of a block's absmax
    logprob_atol = 0.3

    @property
    def checkpoint_config(self):
        return {"quant_method": "bitsandbytes", **MODES[self.mode]}

    def checkpoint_tensors(self, weight):
        tensors, represented = quantized_tensors(weight, self.mode)
        return as_layer_parameters(tensors), represented

    def write_model(self, folder, hf_model, hf_folder):
        save_quantized(hf_folder, folder, self.mode)
        return {"model": folder}

    def refusals(self):
        def method(config):
            return lambda: BitsAndBytesLinearMethod(QuantContext(config, torch.bfloat16, None))

        four = {"quant_method": "bitsandbytes", "load_in_4bit": True}
        return [
            method(None),
            method({"quant_method": "bitsandbytes"}),
            method(four | {"load_in_8bit": True}),
            method(four | {"bnb_4bit_quant_type": "int4"}),
            method(four | {"bnb_4bit_quant_storage": "bfloat16"}),
            method({"quant_method": "bitsandbytes", "load_in_8bit": True, "llm_int8_has_fp16_weight": True}),
        ]


class TestNf4DoubleQuant(BitsAndBytesContract):
    mode = "nf4-double-quant"


class TestFp4(BitsAndBytesContract):
    mode = "fp4"
    quant_error = 0.35  # FP4's widest gap: between 4 and 6 of its 6 (a third of the range)


class TestInt8(BitsAndBytesContract):
    mode = "int8"
    quant_error = 0.01
    logprob_atol = 0.05


def test_names_below_a_weight_become_its_layers_parameters():
    assert tensor_name("m.q_proj.weight.absmax") == "m.q_proj.weight_absmax"
    assert tensor_name("m.q_proj.weight.quant_state.bitsandbytes__nf4") == "m.q_proj.weight_quant_state"
    assert tensor_name("m.q_proj.weight") == "m.q_proj.weight"
    assert tensor_name("m.q_proj.SCB") == "m.q_proj.SCB"


@pytest.mark.parametrize("mode", ["nf4-double-quant"])
def test_a_layer_saved_for_another_shape_is_refused(mode):
    from engine_quant_bitsandbytes.formats import dequantize_4bit

    tensors, _ = quantized_tensors(torch.randn(64, 128), mode)
    named = dict(as_layer_parameters(tensors))
    with pytest.raises(ValueError, match=r"saved as nf4 \[64, 128\] where the model has a nf4 \[128, 64\]"):
        dequantize_4bit(named, 128, 64, "nf4")
