"""Rotary position embeddings (rotate-half layout): the cos/sin tables, looked up once per step;
the rotation itself is :meth:`engine.layers.ops.LayerOps.rotary_qkv`.

Frequencies come from ``transformers``' own rope initialisers, so every scaling type
it knows (default, linear, llama3, yarn, longrope ...) matches the reference exactly.
"""

from __future__ import annotations

import torch

from engine.layers.module import Layer
from engine.layers.ops import LayerOps


def _rope_inv_freq(hf_config, device) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        dim = int(dim * getattr(hf_config, "partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq, 1.0
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, device)


class RotaryEmbedding(Layer):
    def __init__(self, hf_config, max_positions: int, dtype: torch.dtype, ops: LayerOps | None = None):
        super().__init__()
        self.ops = ops or LayerOps()
        inv_freq, scaling = _rope_inv_freq(hf_config, "cpu")
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
        cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
        self.register_buffer("cos", torch.cat([cos, cos], -1).to(dtype), persistent=False)
        self.register_buffer("sin", torch.cat([-sin, sin], -1).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[cos, cos] and [−sin, sin], each [T, 1, D], for these positions: look them up once
        per step and pass them to every layer's ``layer_ops.rotary_qkv``."""
        gather = self.ops.gather_rows
        return gather(self.cos, positions).unsqueeze(1), gather(self.sin, positions).unsqueeze(1)
