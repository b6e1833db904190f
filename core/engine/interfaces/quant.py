"""QuantMethod: how a linear layer stores its weight and multiplies by it.

The core's ``unquantized`` method is the default. A checkpoint's
``quantization_config.quant_method`` or ``--quantization NAME`` selects another.
Lifecycle per layer: ``create_weights`` (register parameters on the layer, each with
an ``output_dim`` attribute for shard loading, or a ``weight_loader(param, tensor,
shard)`` attribute of its own) → weights are loaded → ``process_weights_after_loading``
(repack, quantize online) → ``apply`` every forward.

When the selected method is the one the checkpoint declares, the loader is asked to keep
the file's own quantized form (``ModelLoader.iter_weights(keep_quantized=True)``): the
method's weight loaders then receive whatever objects that loader documents (e.g. raw
GGUF blocks), not float tensors.

Vocabulary-sized layers (input embedding, LM head) go through the method only when it sets
``quantizes_embeddings``; otherwise the core keeps them unquantized.
"""

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import attrs
import torch
import torch.nn.functional as F
from torch import nn


@attrs.frozen
class QuantContext:
    quant_config: dict[str, Any] | None  # from the checkpoint; None for online quantization
    dtype: torch.dtype  # activation dtype
    platform: Any
    batch_invariant: bool = False  # EngineConfig.batch_invariant: Linear runs fixed-size row tiles


class QuantMethod(ABC):
    name: ClassVar[str]
    quantizes_embeddings: ClassVar[bool] = False

    def __init__(self, ctx: QuantContext):
        self.ctx = ctx

    @classmethod
    def supports(cls, platform) -> list[str]:
        """Reasons this method cannot run on ``platform``; empty when it can."""
        return []

    @classmethod
    def describe(cls, platform) -> str:
        """Which kernel path this method takes on ``platform`` and why (``engine plugins``)."""
        return ""

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        """Register the layer's parameters for a [sum(output_sizes), input_size] weight."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack or quantize once all weights are loaded."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [T, in] -> [T, out]."""

    @abstractmethod
    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The layer's weight [out, in] in the activation dtype, by plain math: the reference
        ``apply`` is checked against (dequantize-then-matmul)."""

    def embed(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows ``input_ids`` of the weight [vocab, hidden], for methods that set
        ``quantizes_embeddings``. This default dequantizes the whole table: override it."""
        return F.embedding(input_ids, self.dequantize(layer))
