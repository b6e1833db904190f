"""RMSNorm with the residual add fused in (one pass over the hidden states)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Return norm(x), or (norm(x + residual), x + residual) when a residual is given."""
        if residual is not None:
            x = x + residual
            residual = x
        out = F.rms_norm(x, (x.shape[-1],), self.weight, eps=self.eps)  # float32 accumulation inside
        return out if residual is None else (out, residual)
