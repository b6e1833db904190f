"""The quant-method conformance kit over every GGUF block format the ``gguf`` method keeps
quantized, with real GGUF files for the model check."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from engine.testing.quant import QuantMethodContract
from engine_quant_gguf.formats import GGUFBlocks
from engine_quant_gguf.writer import quantize, write_gguf


class GGUFContract(QuantMethodContract):
    method = "gguf"
    checkpoint_config = {"quant_method": "gguf"}
    qtype: T

    def checkpoint_tensors(self, weight):
        raw = quantize(weight.numpy(), self.qtype)
        plain = dequantize(raw, self.qtype).reshape(weight.shape)
        return [("weight", GGUFBlocks(torch.from_numpy(raw), self.qtype))], torch.from_numpy(plain)

    def write_model(self, folder, hf_model, hf_folder):
        path = f"{folder}/model.{self.qtype.name}.gguf"
        write_gguf(path, hf_model, None, self.qtype)
        return {"model": path}

    def refusals(self):
        from engine_quant_gguf.formats import to_affine

        return [lambda: to_affine(torch.zeros(2, 66, dtype=torch.uint8), T.IQ2_XXS)]


# quant_error: the format's own rounding, max over the weight, relative to max |W| (vocabulary
# tables stay exact: the same planes serve lookups and the LM head). logprob_atol: about
# 1.5× the measured mean |Δ log-prob| of the tiny random model in bf16 (random weights are
# harder on 4 bits than trained ones). On cpu-native the matmuls round activations to int8
# per 32 inputs: Q8_0 went from within 0.025 to 0.026, the 4- and 5-bit formats stayed within
# their bounds (their own rounding dominates).
class TestQ4_0(GGUFContract):
    qtype, quant_error, logprob_atol = T.Q4_0, 0.08, 0.3


class TestQ4_1(GGUFContract):
    qtype, quant_error, logprob_atol = T.Q4_1, 0.06, 0.25


class TestQ5_0(GGUFContract):
    qtype, quant_error, logprob_atol = T.Q5_0, 0.04, 0.13


class TestQ5_1(GGUFContract):
    qtype, quant_error, logprob_atol = T.Q5_1, 0.03, 0.12


class TestQ8_0(GGUFContract):
    qtype, quant_error, logprob_atol = T.Q8_0, 0.01, 0.04


class TestQ4_K(GGUFContract):
    qtype, quant_error, logprob_atol = T.Q4_K, 0.08, 0.22


class TestQ5_K(GGUFContract):
    qtype, quant_error, logprob_atol = T.Q5_K, 0.04, 0.12


class TestQ6_K(GGUFContract):
    qtype, quant_error, logprob_atol = T.Q6_K, 0.03, 0.07


def test_every_supported_format_is_covered():
    from engine_quant_gguf.formats import READERS

    assert {cls.qtype for cls in GGUFContract.__subclasses__()} == set(READERS)


def test_affine_readers_match_ggml_dequantize_on_random_blocks():
    """Arbitrary bytes (sane fp16 scales) read exactly as ggml's reference reads them."""
    from gguf import GGML_QUANT_SIZES

    from engine_quant_gguf.formats import READERS, to_affine

    rng = np.random.default_rng(0)
    scale_offsets = {
        T.Q4_0: [0],
        T.Q4_1: [0, 2],
        T.Q5_0: [0],
        T.Q5_1: [0, 2],
        T.Q8_0: [0],
        T.Q4_K: [0, 2],
        T.Q5_K: [0, 2],
        T.Q6_K: [208],
    }
    for qtype in READERS:
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (6, 512 // block, size), dtype=np.uint8)
        for offset in scale_offsets[qtype]:
            raw[..., offset : offset + 2] = (
                rng.uniform(-0.05, 0.05, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
            )
        raw = raw.reshape(6, -1)
        expected = dequantize(raw, qtype).reshape(6, 512)
        np.testing.assert_array_equal(
            to_affine(torch.from_numpy(raw), qtype).dequantize().numpy(), expected, err_msg=qtype.name
        )
