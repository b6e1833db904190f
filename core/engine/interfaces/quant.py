"""QuantMethod: how a linear layer stores its weight and multiplies by it.

The core's ``unquantized`` method is the default. A checkpoint's
``quantization_config.quant_method`` or ``--quantization NAME`` selects another.
Lifecycle per layer: ``create_weights`` (register parameters on the layer, each with
an ``output_dim`` attribute for shard loading, or a ``weight_loader(param, tensor,
shard)`` attribute of its own) → weights are loaded → ``process_weights_after_loading``
(repack, quantize online) → ``apply`` every forward.
"""

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import attrs
import torch
from torch import nn


@attrs.frozen
class QuantContext:
    quant_config: dict[str, Any] | None  # from the checkpoint; None for online quantization
    dtype: torch.dtype  # activation dtype
    platform: Any


class QuantMethod(ABC):
    name: ClassVar[str]

    def __init__(self, ctx: QuantContext):
        self.ctx = ctx

    @classmethod
    def supports(cls, platform) -> list[str]:
        """Reasons this method cannot run on ``platform``; empty when it can."""
        return []

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        """Register the layer's parameters for a [sum(output_sizes), input_size] weight."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack or quantize once all weights are loaded."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [T, in] -> [T, out]."""
