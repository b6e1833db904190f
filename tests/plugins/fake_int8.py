"""Test plugin for the quant-method seam: online round-to-nearest int8 with per-row scales,
dequantized in ``apply`` (the slow reference a real method would speed up)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import hookimpl
from engine.interfaces import QuantMethod


@hookimpl
def register_quant_methods(register):
    register("test-int8", FakeInt8, api=2)


class FakeInt8(QuantMethod):
    def create_weights(self, layer, input_size, output_sizes):
        weight = nn.Parameter(
            torch.empty(sum(output_sizes), input_size, dtype=self.ctx.dtype), requires_grad=False
        )
        weight.output_dim = 0
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer):
        w = layer.weight.data.float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
        layer.qweight = nn.Parameter((w / scale).round().to(torch.int8), requires_grad=False)
        layer.scale = nn.Parameter(scale.to(self.ctx.dtype), requires_grad=False)
        del layer.weight

    def dequantize(self, layer):
        return layer.qweight.to(self.ctx.dtype) * layer.scale

    def apply(self, layer, x, bias):
        return F.linear(x, self.dequantize(layer), bias)
