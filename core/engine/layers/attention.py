"""The attention layer a model places where it attends: it hands q/k/v, this layer's cache
and the step's metadata to the selected backend, and, when the cache is quantized, this layer's
KV scales (set from the checkpoint by :mod:`engine.layers.kv_scales`). A layer caching a
latent vector per token (MLA: ``AttentionKind.latent``) places :class:`LatentAttention`."""

from __future__ import annotations

import torch

from engine.interfaces.attention import KVScale, LatentUpProjection
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


class LatentAttention(Layer):
    """(models v3) Where an MLA layer attends: its queries (without and with rotary part), this
    step's normalized latent and rotated shared key part, and the layer's up-projection go to
    the backend's ``forward_latent`` over this layer's latent cache, inside the KV connector's
    per-layer hooks as :class:`Attention` calls them."""

    def __init__(self, layer_index: int):
        super().__init__()
        self.layer_index = layer_index

    def forward(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        up: LatentUpProjection,
        step: StepContext,
    ) -> torch.Tensor:
        backend, metadata = step.layer_attention(self.layer_index)
        connector, cache = step.kv_connector, step.kv_caches[self.layer_index]
        if connector is not None:
            connector.wait_for_layer_load(self.layer_index)
        out = backend.forward_latent(q_nope, q_rope, latent, k_rope, cache, metadata, up)
        if connector is not None:
            connector.save_kv_layer(self.layer_index, cache, step.slot_mapping)
        return out
