"""Qwen3 dense decoders over the flattened token axis: Llama's shape (fused QKV and gate|up
projections, GQA, RoPE, tied or untied LM head) plus a per-head RMSNorm of q and k before
the rotation, and a ``head_dim`` of its own (Qwen3's heads are usually wider than
hidden / heads). Parameter names follow Hugging Face's so checkpoints load as they are."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.interfaces import KVLayout, Model
from engine.layers import (
    Attention,
    Layer,
    LayerOps,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    load_checkpoint,
)


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class Qwen3Attention(Layer):
    def __init__(self, cfg, layer: int, method, dtype, ops: LayerOps):
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = \
            cfg.num_attention_heads, cfg.num_key_value_heads, _head_dim(cfg)
        bias = getattr(cfg, "attention_bias", False)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [q_size, kv_size, kv_size], bias, method, dtype)
        self.o_proj = Linear(q_size, [cfg.hidden_size], bias, method, dtype)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, ops)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, ops)
        self.attn = Attention(layer)

    def forward(self, cos_sin, hidden, step):
        q, k, v = self.ops.qk_norm_rotary(self.qkv_proj(hidden), self.q_norm, self.k_norm, self.num_heads,
                                          self.num_kv_heads, self.head_dim, cos_sin)
        out = self.attn(q, k, v, step)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class Qwen3MLP(Layer):
    def __init__(self, cfg, method, dtype, ops: LayerOps):
        super().__init__()
        self.ops = ops
        self.gate_up_proj = Linear(cfg.hidden_size, [cfg.intermediate_size] * 2, False, method, dtype)
        self.down_proj = Linear(cfg.intermediate_size, [cfg.hidden_size], False, method, dtype)

    def forward(self, x):
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class Qwen3DecoderLayer(Layer):
    def __init__(self, cfg, layer: int, method, dtype, ops: LayerOps):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.self_attn = Qwen3Attention(cfg, layer, method, dtype, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.mlp = Qwen3MLP(cfg, method, dtype, ops)

    def forward(self, cos_sin, hidden, residual, step):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(cos_sin, hidden, step)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3Model(Layer):
    def __init__(self, cfg, method, dtype, ops: LayerOps):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, method, dtype)
        self.rotary = RotaryEmbedding(cfg, cfg.max_position_embeddings, dtype)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, i, method, dtype, ops)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)

    def forward(self, input_ids, positions, step):
        hidden, residual = self.embed_tokens(input_ids), None
        cos_sin = self.rotary(positions)
        for index, layer in enumerate(self.layers):
            hidden, residual = layer(cos_sin, hidden, residual, step)
            if index in step.aux_layers:
                step.aux_hidden.append(hidden + residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3ForCausalLM(Model):
    architectures = ("Qwen3ForCausalLM",)

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg = ctx.hf_config
        self.cfg = cfg
        self.model = Qwen3Model(cfg, ctx.linear_method, ctx.dtype, ctx.layer_ops or LayerOps())
        self.tied = getattr(cfg, "tie_word_embeddings", False)
        if not self.tied:
            self.lm_head = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.linear_method, ctx.dtype)

    @classmethod
    def supports(cls, hf_config) -> list[str]:
        if getattr(hf_config, "use_sliding_window", False) and getattr(hf_config, "sliding_window", None):
            return ["sliding-window attention (use_sliding_window) is not supported"]
        return []

    @classmethod
    def example_configs(cls) -> dict[str, dict]:
        """Qwen3's own shape (head_dim wider than hidden / heads, GQA, tied head as the
        small Qwen3 checkpoints have), an untied one, and one with no GQA whose head_dim is
        hidden / heads."""
        tiny = dict(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, max_position_embeddings=256)
        return {
            "Qwen3ForCausalLM": dict(**tiny, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                     tie_word_embeddings=True),
            "Qwen3ForCausalLM-untied-gqa4": dict(**tiny, num_attention_heads=8, num_key_value_heads=2,
                                                 head_dim=24, tie_word_embeddings=False),
            "Qwen3ForCausalLM-mha-narrow-heads": dict(**tiny, num_attention_heads=4, num_key_value_heads=4,
                                                      head_dim=16, tie_word_embeddings=False, rope_theta=10000.0),
        }

    def kv_layout(self) -> KVLayout:
        cfg = self.cfg
        return KVLayout(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, _head_dim(cfg))

    def forward(self, input_ids, positions, step):
        return self.model(input_ids, positions, step)

    def embed(self, input_ids):
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden):
        head = self.model.embed_tokens if self.tied else self.lm_head
        return head.logits(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(name: str) -> str | None:
            return None if "rotary_emb" in name or (self.tied and name == "lm_head.weight") else name

        load_checkpoint(self, weights, rename)
