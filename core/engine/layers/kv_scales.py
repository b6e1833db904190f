"""Per-layer KV cache scales from a checkpoint, under vLLM's names: ``...layers.<i>.self_attn.
k_scale`` / ``v_scale`` (also under ``.attn.``), or one ``kv_scale`` for both (older FP8
checkpoints). They are taken out of the weights before the model loads them — a model has no
parameter for them — and set on each layer's :class:`engine.layers.attention.Attention`; a
layer without one keeps 1.0, as in vLLM. They matter only for a quantized KV cache."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from engine.interfaces.attention import KVScale
from engine.layers.attention import Attention
from engine.layers.checkpoint import materialize

_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|attention)\.(?:attn\.)?(k_scale|v_scale|kv_scale)$")


class KVScales:
    """Collects the scales while the weights stream past (:meth:`strip`), then sets them
    (:meth:`apply`)."""

    def __init__(self) -> None:
        self.found: dict[int, dict[str, float]] = {}

    def strip(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """``weights`` without the KV scales, which are kept."""
        for name, tensor in weights:
            match = _NAME.search(name)
            if match is None:
                yield name, tensor
                continue
            value = _scalar(name, tensor)
            layer, kind = int(match.group(1)), match.group(2)
            for part in ("k", "v") if kind == "kv_scale" else (kind[0],):
                self.found.setdefault(layer, {})[part] = value

    def apply(self, model: nn.Module) -> None:
        """Each attention layer's scales (1.0 where the checkpoint has none)."""
        for module in model.modules():
            if isinstance(module, Attention) and module.layer_index in self.found:
                module.kv_scale = KVScale(**self.found[module.layer_index])


def _scalar(name: str, tensor) -> float:
    """A per-tensor scale as a float; ValueError naming the tensor when it is not one positive number."""
    value = torch.as_tensor(materialize(tensor)).float()
    if value.numel() != 1 or not (float(value) > 0 and torch.isfinite(value).all()):
        raise ValueError(f"checkpoint tensor {name!r}: a KV cache scale must be one positive number")
    return float(value)
