"""Planted bugs: the int8 weight-only quant method with one mistake each, the mistakes quant
method authors make (each passes a check written against Llama's bias-free projections,
loaded q, k, v in order, with rows of one magnitude). Not registered by the suite's conftest:
``tests/test_quant_kit_mutations.py`` registers them in a child pytest that runs the quant
kit on each, and checks that it fails."""

from __future__ import annotations

import torch

from engine import hookimpl
from engine.layers.int8 import Int8Rows, row_abs_max
from engine_quant_int8.method import Int8WeightOnly


class PerTensorScale(Int8WeightOnly):
    """One scale for the whole weight (its largest magnitude), not one per output row."""

    def process_weights_after_loading(self, layer):
        weight = layer.weight.data
        abs_max = row_abs_max(weight).amax().expand(weight.shape[0])
        layer.int8 = Int8Rows.from_float(weight, self.ctx.dtype, abs_max=abs_max)
        del layer.weight


class ShardsInArrivalOrder(Int8WeightOnly):
    """Collects the q, k, v tensors as they arrive and concatenates them, ignoring the shard id."""

    def create_weights(self, layer, input_size, output_sizes):
        super().create_weights(layer, input_size, output_sizes)
        arrived = layer.arrived = []
        layer.weight.weight_loader = lambda param, tensor, shard: arrived.append(tensor)

    def process_weights_after_loading(self, layer):
        layer.weight.data.copy_(torch.cat(layer.arrived))
        del layer.arrived
        super().process_weights_after_loading(layer)


class DropsBias(Int8WeightOnly):
    """Returns the int8 matmul without adding the bias (Llama has none)."""

    def apply(self, layer, x, bias):
        return self._matmul(layer.int8, x)


class Truncates(Int8WeightOnly):
    """Casts ``weight / scale`` to int8 without rounding: truncation toward zero."""

    def process_weights_after_loading(self, layer):
        weight = layer.weight.data.float()
        scale = row_abs_max(weight).clamp(min=1e-12) / 127
        layer.int8 = Int8Rows((weight / scale[:, None]).to(torch.int8), scale, self.ctx.dtype)
        del layer.weight


MUTANTS = {
    "per-tensor-scale": PerTensorScale,
    "shards-in-arrival-order": ShardsInArrivalOrder,
    "drops-bias": DropsBias,
    "truncates": Truncates,
}


@hookimpl
def register_quant_methods(register):
    for name, method in MUTANTS.items():
        register(name, method, api=3)
