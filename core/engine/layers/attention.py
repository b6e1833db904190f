"""The attention layer a model places where it attends: it hands q/k/v, this layer's cache
and the step's metadata to the selected backend, and, when the cache is quantized, this layer's
KV scales (set from the checkpoint by :mod:`engine.layers.kv_scales`, or under
``--calculate-kv-scales`` from the first keys and values it stores), and a layer's attention
sink logits where its kind has them (``AttentionKind.sinks``, models v4). A layer caching a
latent vector per token (MLA: ``AttentionKind.latent``) places :class:`LatentAttention`."""

from __future__ import annotations

import torch

from engine.interfaces.attention import KVScale, LatentUpProjection
from engine.interfaces.model import StepContext
from engine.layers.module import Layer

# vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT: a calculated scale maps max |k| to 200, max |v|
# to 100 in the cache (e4m3 holds up to 448, so the first prefill's extremes keep headroom)
K_SCALE_RANGE, V_SCALE_RANGE = 200.0, 100.0


class Attention(Layer):
    def __init__(self, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.kv_scale = KVScale()
        # --calculate-kv-scales: set kv_scale from the first keys and values a quantized cache
        # stores (the first prefill), then never again
        self.calculate_kv_scale = False

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        step: StepContext,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``sinks``: this rank's heads' sink logits (float32 [H]) for a layer whose kind has them."""
        backend, metadata = step.layer_attention(self.layer_index)
        connector, cache = step.kv_connector, step.kv_caches[self.layer_index]
        if connector is None:
            return self._attend(backend, q, k, v, cache, metadata, sinks)
        connector.wait_for_layer_load(self.layer_index)
        out = self._attend(backend, q, k, v, cache, metadata, sinks)
        connector.save_kv_layer(self.layer_index, cache, step.slot_mapping)
        return out

    def _attend(self, backend, q, k, v, cache, metadata, sinks) -> torch.Tensor:
        """``kv_scale=`` only for a quantized cache and ``sinks=`` only for a spec with sinks: a
        backend that reads neither never takes them."""
        extra: dict = {}
        if backend.spec.kv_cache_dtype is not None:
            if self.calculate_kv_scale and k.numel():
                self.kv_scale = calculated_kv_scale(k, v)
                self.calculate_kv_scale = False
            extra["kv_scale"] = self.kv_scale
        if backend.spec.sinks:
            if sinks is None:
                raise ValueError(f"layer {self.layer_index} attends with sinks but was handed none")
            extra["sinks"] = sinks
        return backend.forward(q, k, v, cache, metadata, **extra)


def calculated_kv_scale(k: torch.Tensor, v: torch.Tensor) -> KVScale:
    """vLLM's calculated scales of keys and values: max |k| / 200, max |v| / 100 (1.0 for an
    all-zero tensor, which any scale stores exactly)."""
    k_max, v_max = float(k.abs().max()), float(v.abs().max())
    return KVScale(
        k=k_max / K_SCALE_RANGE if k_max > 0 else 1.0, v=v_max / V_SCALE_RANGE if v_max > 0 else 1.0
    )


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
