"""Llama and the families with its shape: fused QKV and gate|up projections over the
flattened token axis, GQA, RoPE (incl. llama3 scaling), optional QKV bias (Qwen2) and
tied embeddings. Parameter names follow Hugging Face's so checkpoints load as they are."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.interfaces import AttentionKind, KVLayout, Model
from engine.layers import (
    Attention,
    Layer,
    LayerOps,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    decoder_rename,
    load_checkpoint,
)


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class LlamaAttention(Layer):
    def __init__(self, cfg, layer: int, method, dtype, ops: LayerOps):
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = \
            cfg.num_attention_heads, cfg.num_key_value_heads, _head_dim(cfg)
        qkv_bias = getattr(cfg, "attention_bias", False) or cfg.model_type == "qwen2"
        o_bias = getattr(cfg, "attention_bias", False) and cfg.model_type != "qwen2"
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [q_size, kv_size, kv_size], qkv_bias, method, dtype)
        self.o_proj = Linear(q_size, [cfg.hidden_size], o_bias, method, dtype)
        self.attn = Attention(layer)

    def forward(self, cos_sin, hidden, step):
        q, k, v = self.ops.rotary_qkv(self.qkv_proj(hidden), self.num_heads, self.num_kv_heads, self.head_dim,
                                      cos_sin)
        out = self.attn(q, k, v, step)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class LlamaMLP(Layer):
    def __init__(self, cfg, method, dtype, ops: LayerOps):
        super().__init__()
        self.ops = ops
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = Linear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias, method, dtype)
        self.down_proj = Linear(cfg.intermediate_size, [cfg.hidden_size], bias, method, dtype)

    def forward(self, x):
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(Layer):
    def __init__(self, cfg, layer: int, method, dtype, ops: LayerOps):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.self_attn = LlamaAttention(cfg, layer, method, dtype, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.mlp = LlamaMLP(cfg, method, dtype, ops)

    def forward(self, cos_sin, hidden, residual, step):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(cos_sin, hidden, step)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(Layer):
    def __init__(self, cfg, method, dtype, ops: LayerOps):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, method, dtype)
        self.rotary = RotaryEmbedding(cfg, cfg.max_position_embeddings, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, method, dtype, ops)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)

    def forward(self, input_ids, positions, step, num_layers: int | None = None):
        hidden, residual = self.embed_tokens(input_ids), None
        cos_sin = self.rotary(positions)
        for index, layer in enumerate(self.layers[:num_layers]):
            hidden, residual = layer(cos_sin, hidden, residual, step)
            if index in step.aux_layers:
                step.aux_hidden.append(hidden + residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(Model):
    architectures = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg = ctx.hf_config
        self.cfg = cfg
        self.model = LlamaModel(cfg, ctx.linear_method, ctx.dtype, ctx.layer_ops or LayerOps())
        self.tied = getattr(cfg, "tie_word_embeddings", False)
        if not self.tied:
            self.lm_head = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.linear_method, ctx.dtype)

    @classmethod
    def supports(cls, hf_config) -> list[str]:
        reasons = []
        if hf_config.model_type != "mistral" and getattr(hf_config, "use_sliding_window", False):
            reasons.append("sliding-window attention on some layers (Qwen2's use_sliding_window) is not supported")
        return reasons

    @classmethod
    def example_configs(cls) -> dict[str, dict]:
        tiny = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        return {
            "LlamaForCausalLM": dict(model_type="llama", **tiny, tie_word_embeddings=False),
            "LlamaForCausalLM-llama3-rope-tied": dict(
                model_type="llama", **tiny, tie_word_embeddings=True,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
            "MistralForCausalLM": dict(model_type="mistral", **tiny, sliding_window=None),
            "MistralForCausalLM-sliding-window": dict(model_type="mistral", **tiny, sliding_window=16),
            "Qwen2ForCausalLM": dict(model_type="qwen2", **tiny, tie_word_embeddings=False),
        }

    def kv_layout(self) -> KVLayout:
        """Mistral's ``sliding_window``, when set, applies to every layer."""
        cfg = self.cfg
        window = getattr(cfg, "sliding_window", None) if cfg.model_type == "mistral" else None
        kinds = (AttentionKind(sliding_window=window),) * cfg.num_hidden_layers if window else ()
        return KVLayout(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, _head_dim(cfg),
                        kinds)

    def forward(self, input_ids, positions, step):
        return self.model(input_ids, positions, step)

    def embed(self, input_ids):
        return self.model.embed_tokens(input_ids)

    def draft_view(self, num_layers: int):
        if not 0 < num_layers < self.cfg.num_hidden_layers:
            raise ValueError(f"self_draft_layers must be in [1, {self.cfg.num_hidden_layers - 1}]")
        return LayerSkipView(self, num_layers)

    def compute_logits(self, hidden):
        head = self.model.embed_tokens if self.tied else self.lm_head
        return head.logits(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint(self, weights, decoder_rename(self.tied))


class LayerSkipView(nn.Module):
    """The first layers of a Llama and its LM head, sharing the target's modules."""

    def __init__(self, target: LlamaForCausalLM, num_layers: int):
        super().__init__()
        self.num_layers = num_layers
        self._target = [target]  # a list, so the target is not registered as a submodule twice

    def kv_layout(self) -> KVLayout:
        full = self._target[0].kv_layout()
        return KVLayout(self.num_layers, full.num_heads, full.num_kv_heads, full.head_dim,
                        full.layer_kinds[:self.num_layers])

    def forward(self, input_ids, positions, step):
        return self._target[0].model(input_ids, positions, step, num_layers=self.num_layers)

    def compute_logits(self, hidden):
        return self._target[0].compute_logits(hidden)
