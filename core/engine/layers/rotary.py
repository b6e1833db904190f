"""Rotary position embeddings (rotate-half layout): the cos/sin tables, looked up once per step;
the rotation itself is :meth:`engine.layers.ops.LayerOps.rotary_qkv` (or, where the tables
are narrower than a head, ``partial_rotary_qkv``).

Frequencies come from ``transformers``' own rope initialisers, so every scaling type
it knows (default, linear, llama3, yarn, longrope ...) matches the reference exactly. A
``partial_rotary_factor`` (Phi-3/Phi-4, GLM-4) makes the tables that fraction of head_dim wide.
"""

from __future__ import annotations

import torch

from engine.layers.module import Layer
from engine.layers.ops import LayerOps


def _rope_params(hf_config) -> tuple[dict, str]:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    return params, params.get("rope_type", params.get("type", "default"))


def _rope_inv_freq(hf_config, device) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params, rope_type = _rope_params(hf_config)
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
        dim = int(dim * factor)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq, 1.0
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, device)


def _position_freqs(hf_config, max_positions: int) -> tuple[torch.Tensor, float]:
    """Angles [positions, rotary_dim / 2] and the cos/sin scaling. LongRoPE (Phi-3) has two sets
    of frequencies: ``transformers`` switches a whole sequence to the long ones once it outgrows
    ``original_max_position_embeddings``, which a paged cache cannot follow (keys already cached
    keep their rotation); here, as in vLLM, a position past it takes the long ones and every
    earlier position the short ones, which matches ``transformers`` for sequences within it."""
    inv_freq, scaling = _rope_inv_freq(hf_config, "cpu")
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
    params, rope_type = _rope_params(hf_config)
    original = (
        params.get("original_max_position_embeddings")
        or getattr(hf_config, "original_max_position_embeddings", None)
        or max_positions
    )
    if rope_type == "longrope" and original < max_positions:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](hf_config, "cpu", seq_len=original + 1)
        positions = torch.arange(original, max_positions, dtype=torch.float32)
        freqs[original:] = torch.outer(positions, long_inv_freq.float())
    return freqs, scaling


class RotaryEmbedding(Layer):
    def __init__(self, hf_config, max_positions: int, dtype: torch.dtype, ops: LayerOps | None = None):
        super().__init__()
        self.ops = ops or LayerOps()
        freqs, scaling = _position_freqs(hf_config, max_positions)
        cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
        self.register_buffer("cos", torch.cat([cos, cos], -1).to(dtype), persistent=False)
        self.register_buffer("sin", torch.cat([-sin, sin], -1).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[cos, cos] and [−sin, sin], each [T, 1, D], for these positions: look them up once
        per step and pass them to every layer's ``layer_ops.rotary_qkv``."""
        gather = self.ops.gather_rows
        return gather(self.cos, positions).unsqueeze(1), gather(self.sin, positions).unsqueeze(1)
