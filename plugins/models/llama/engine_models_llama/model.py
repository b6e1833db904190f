"""Llama and the families with its shape: fused QKV and gate|up projections over the
flattened token axis, GQA, RoPE (incl. llama3 scaling), optional QKV bias (Qwen2) and
tied embeddings. Parameter names follow Hugging Face's so checkpoints load as they are."""

from __future__ import annotations

from torch import nn

from engine.interfaces import KVLayout
from engine.layers import (
    Attention,
    DecoderForCausalLM,
    DecoderStack,
    Layer,
    LayerOps,
    Linear,
    PreNormDecoderLayer,
    RMSNorm,
    head_dim,
)


class LlamaAttention(Layer):
    def __init__(self, cfg, layer: int, method, dtype, ops: LayerOps):
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = \
            cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(cfg)
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


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg, layer: int, method, dtype, ops: LayerOps):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.self_attn = LlamaAttention(cfg, layer, method, dtype, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.mlp = LlamaMLP(cfg, method, dtype, ops)


class LlamaForCausalLM(DecoderForCausalLM):
    architectures = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

    def build_decoder(self, cfg, method, dtype, ops: LayerOps) -> DecoderStack:
        layers = (LlamaDecoderLayer(cfg, i, method, dtype, ops) for i in range(cfg.num_hidden_layers))
        return DecoderStack(cfg, layers, method, dtype, ops)

    @classmethod
    def supports(cls, hf_config) -> list[str]:
        reasons = []
        if getattr(hf_config, "sliding_window", None) and (
                hf_config.model_type == "mistral" or getattr(hf_config, "use_sliding_window", False)):
            reasons.append("sliding-window attention is not supported")
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
            "Qwen2ForCausalLM": dict(model_type="qwen2", **tiny, tie_word_embeddings=False),
        }

    def draft_view(self, num_layers: int):
        if not 0 < num_layers < self.cfg.num_hidden_layers:
            raise ValueError(f"self_draft_layers must be in [1, {self.cfg.num_hidden_layers - 1}]")
        return LayerSkipView(self, num_layers)


class LayerSkipView(nn.Module):
    """The first layers of a Llama and its LM head, sharing the target's modules."""

    def __init__(self, target: LlamaForCausalLM, num_layers: int):
        super().__init__()
        self.num_layers = num_layers
        self._target = [target]  # a list, so the target is not registered as a submodule twice

    def kv_layout(self) -> KVLayout:
        full = self._target[0].kv_layout()
        return KVLayout(self.num_layers, full.num_heads, full.num_kv_heads, full.head_dim)

    def forward(self, input_ids, positions, step):
        return self._target[0].model(input_ids, positions, step, num_layers=self.num_layers)

    def compute_logits(self, hidden):
        return self._target[0].compute_logits(hidden)
