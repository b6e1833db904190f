"""RMSNorm with the residual add fused in: its weight, and a call into the model's
:class:`engine.layers.ops.LayerOps` (plain torch unless the platform brings kernels)."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.module import Layer
from engine.layers.ops import LayerOps


class RMSNorm(Layer):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, ops: LayerOps | None = None):
        super().__init__()
        self.eps = eps
        self.ops = ops or LayerOps()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.doubled_weight: torch.Tensor | None = None  # [w, w] for the layer-norm form, once loaded

    def process_weights_after_loading(self) -> None:
        self.doubled_weight = torch.cat([self.weight.data, self.weight.data])

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Return norm(x), or (norm(x + residual), x + residual) when a residual is given
        (then x and residual are consumed: the ops may overwrite them)."""
        return self.ops.rms_norm(self, x, residual)
