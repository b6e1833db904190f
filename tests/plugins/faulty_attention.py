"""Test plugin: attention backends with the bugs the conformance kit must catch, each passing
plain single-layer, contiguous-input checks. ``test-first-layer-cache`` keeps the first
layer's cache for the whole step (a per-step gather memoized across layers);
``test-contiguous-q`` reads q as if it were contiguous (a kernel that takes its data pointer
and assumes dense rows)."""

from __future__ import annotations

import torch

from engine import hookimpl
from engine_attention_torch.backend import TorchAttentionBackend


@hookimpl
def register_attention_backends(register):
    register("test-first-layer-cache", FirstLayerCacheBackend, api=1)
    register("test-contiguous-q", ContiguousQueryBackend, api=1)


class FirstLayerCacheBackend(TorchAttentionBackend):
    name = "test-first-layer-cache"

    def __init__(self, spec, platform):
        super().__init__(spec, platform)
        self._step = self._cache = None

    def forward(self, query, key, value, kv_cache, metadata):
        if metadata is not self._step:  # a new step: its first layer's cache serves them all
            self._step, self._cache = metadata, kv_cache
        return super().forward(query, key, value, self._cache, metadata)


class ContiguousQueryBackend(TorchAttentionBackend):
    name = "test-contiguous-q"

    def forward(self, query, key, value, kv_cache, metadata):
        dense = torch.as_strided(
            query, query.shape, torch.empty(query.shape).stride(), query.storage_offset()
        )
        return super().forward(dense, key, value, kv_cache, metadata)
