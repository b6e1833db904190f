"""The attention layer a model places where it attends: it hands q/k/v, this layer's cache
and the step's metadata to the selected backend, and, when the cache is quantized, this layer's
KV scales (set from the checkpoint by :mod:`engine.layers.kv_scales`)."""

from __future__ import annotations

import torch

from engine.interfaces.attention import KVScale
from engine.interfaces.model import StepContext
from engine.layers.module import Layer


class Attention(Layer):
    def __init__(self, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.kv_scale = KVScale()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepContext) -> torch.Tensor:
        backend, metadata = step.layer_attention(self.layer_index)
        connector, cache = step.kv_connector, step.kv_caches[self.layer_index]
        if connector is None:
            return self._attend(backend, q, k, v, cache, metadata)
        connector.wait_for_layer_load(self.layer_index)
        out = self._attend(backend, q, k, v, cache, metadata)
        connector.save_kv_layer(self.layer_index, cache, step.slot_mapping)
        return out

    def _attend(self, backend, q, k, v, cache, metadata) -> torch.Tensor:
        """``kv_scale=`` only for a quantized cache: a backend that reads none never takes it."""
        if backend.spec.kv_cache_dtype is None:
            return backend.forward(q, k, v, cache, metadata)
        return backend.forward(q, k, v, cache, metadata, kv_scale=self.kv_scale)
