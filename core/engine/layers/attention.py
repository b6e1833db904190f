"""The attention layer a model places where it attends: it hands q/k/v, this layer's cache
and the step's metadata to the selected backend."""

from __future__ import annotations

import torch

from engine.interfaces.model import StepContext
from engine.layers.module import Layer


class Attention(Layer):
    def __init__(self, layer_index: int):
        super().__init__()
        self.layer_index = layer_index

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepContext) -> torch.Tensor:
        backend, metadata = step.layer_attention(self.layer_index)
        connector, cache = step.kv_connector, step.kv_caches[self.layer_index]
        if connector is None:
            return backend.forward(q, k, v, cache, metadata)
        connector.wait_for_layer_load(self.layer_index)
        out = backend.forward(q, k, v, cache, metadata)
        connector.save_kv_layer(self.layer_index, cache, step.slot_mapping)
        return out
