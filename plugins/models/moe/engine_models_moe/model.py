"""Mixture-of-experts decoders: Mixtral, Qwen3-MoE and Qwen2-MoE over the flattened token axis.

Attention is Llama's (fused QKV, GQA, RoPE), with Qwen3-MoE's per-head RMSNorm on q and k
before the rotation and Qwen2-MoE's QKV bias. The feed-forward of a sparse layer is the
core's :class:`engine.layers.FusedMoE` (stacked experts, one grouped matmul per projection)
behind a router kept unquantized; Qwen2-MoE adds a shared expert scaled by a sigmoid gate;
the Qwen families' ``mlp_only_layers`` and ``decoder_sparse_step`` give dense layers.
Parameter names follow Hugging Face's, so checkpoints (experts stored one per tensor) load as
they are.
"""

from __future__ import annotations

import attrs
import torch

from engine.layers import (
    Attention,
    DecoderForCausalLM,
    DecoderStack,
    FusedMoE,
    Layer,
    LayerOps,
    Linear,
    PreNormDecoderLayer,
    RMSNorm,
    head_dim,
    router_linear,
)


@attrs.frozen
class Family:
    """How one architecture's config and checkpoint spell the same model."""

    moe_attr: str  # the decoder layer's attribute holding the sparse block
    num_experts_key: str
    expert_size_key: str  # each expert's intermediate size
    qk_norm: bool
    qkv_bias: bool

    def renormalize(self, cfg) -> bool:
        return getattr(cfg, "norm_topk_prob", True)  # Mixtral always renormalizes (and has no such key)

    def is_sparse(self, cfg, layer: int) -> bool:
        return (layer not in (getattr(cfg, "mlp_only_layers", None) or [])
                and getattr(cfg, self.num_experts_key) > 0
                and (layer + 1) % getattr(cfg, "decoder_sparse_step", 1) == 0)


FAMILIES = {
    "mixtral": Family("block_sparse_moe", "num_local_experts", "intermediate_size", qk_norm=False, qkv_bias=False),
    "qwen3_moe": Family("mlp", "num_experts", "moe_intermediate_size", qk_norm=True, qkv_bias=False),
    "qwen2_moe": Family("mlp", "num_experts", "moe_intermediate_size", qk_norm=False, qkv_bias=True),
}


class MoeAttention(Layer):
    def __init__(self, cfg, family: Family, layer: int, method, dtype, ops: LayerOps):
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = \
            cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(cfg)
        attention_bias = getattr(cfg, "attention_bias", False)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [q_size, kv_size, kv_size], family.qkv_bias or attention_bias,
                               method, dtype)
        self.o_proj = Linear(q_size, [cfg.hidden_size], attention_bias, method, dtype)
        if family.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, ops)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, ops)
        self.attn = Attention(layer)

    def forward(self, cos_sin, hidden, step):
        qkv = self.qkv_proj(hidden)
        if hasattr(self, "q_norm"):
            self._norm_heads(qkv)
        q, k, v = self.ops.rotary_qkv(qkv, self.num_heads, self.num_kv_heads, self.head_dim, cos_sin)
        out = self.attn(q, k, v, step)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))

    def _norm_heads(self, qkv: torch.Tensor) -> None:
        """Qwen3's per-head RMSNorm of q and k, in place in the fused projection (as 2-D rows
        of one head each: the form every platform's RMSNorm takes)."""
        heads = qkv.view(qkv.shape[0], -1, self.head_dim)
        for norm, start, count in ((self.q_norm, 0, self.num_heads),
                                   (self.k_norm, self.num_heads, self.num_kv_heads)):
            part = heads[:, start:start + count]
            part.copy_(norm(part.reshape(-1, self.head_dim)).view_as(part))


class GatedMLP(Layer):
    """A dense SwiGLU feed-forward: the dense layers' MLP and Qwen2-MoE's shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, method, dtype, ops: LayerOps):
        super().__init__()
        self.ops = ops
        self.gate_up_proj = Linear(hidden_size, [intermediate_size] * 2, False, method, dtype)
        self.down_proj = Linear(intermediate_size, [hidden_size], False, method, dtype)

    def forward(self, x):
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class SparseMoeBlock(Layer):
    """Router + experts (+ Qwen2-MoE's gated shared expert, when the config sizes one)."""

    def __init__(self, cfg, family: Family, method, dtype, ops: LayerOps):
        super().__init__()
        num_experts = getattr(cfg, family.num_experts_key)
        self.gate = router_linear(cfg.hidden_size, num_experts, method, dtype)
        self.experts = FusedMoE(num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                getattr(cfg, family.expert_size_key), family.renormalize(cfg), method, dtype, ops)
        shared = getattr(cfg, "shared_expert_intermediate_size", 0)
        if shared:
            self.shared_expert = GatedMLP(cfg.hidden_size, shared, method, dtype, ops)
            self.shared_expert_gate = router_linear(cfg.hidden_size, 1, method, dtype)

    def forward(self, x):
        out = self.experts(x, self.gate(x))
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoeDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg, family: Family, layer: int, method, dtype, ops: LayerOps):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.self_attn = MoeAttention(cfg, family, layer, method, dtype, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        if family.is_sparse(cfg, layer):
            feed_forward = SparseMoeBlock(cfg, family, method, dtype, ops)
        else:
            feed_forward = GatedMLP(cfg.hidden_size, cfg.intermediate_size, method, dtype, ops)
        self.moe_attr = family.moe_attr
        setattr(self, family.moe_attr, feed_forward)  # the checkpoint's name for it

    def feed_forward(self, hidden):
        return getattr(self, self.moe_attr)(hidden)


class MoeForCausalLM(DecoderForCausalLM):
    architectures = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")

    def build_decoder(self, cfg, method, dtype, ops: LayerOps) -> DecoderStack:
        family = FAMILIES[cfg.model_type]
        layers = (MoeDecoderLayer(cfg, family, i, method, dtype, ops) for i in range(cfg.num_hidden_layers))
        return DecoderStack(cfg, layers, method, dtype, ops)

    @classmethod
    def supports(cls, hf_config) -> list[str]:
        if hf_config.model_type not in FAMILIES:
            return [f"model_type {hf_config.model_type!r} is not one of {sorted(FAMILIES)}"]
        reasons = []
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            reasons.append(f"hidden_act {hf_config.hidden_act!r}: the experts are SwiGLU (silu) only")
        windowed = (getattr(hf_config, "use_sliding_window", False) if hf_config.model_type != "mixtral"
                    else getattr(hf_config, "sliding_window", None))
        if windowed:
            reasons.append("sliding-window attention is not supported")
        return reasons

    @classmethod
    def example_configs(cls) -> dict[str, dict]:
        tiny = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=256)
        return {
            "MixtralForCausalLM": dict(model_type="mixtral", **tiny, intermediate_size=96, num_local_experts=4,
                                       num_experts_per_tok=2, tie_word_embeddings=False),
            "MixtralForCausalLM-top1-tied": dict(model_type="mixtral", **tiny, intermediate_size=96,
                                                 num_local_experts=8, num_experts_per_tok=1,
                                                 tie_word_embeddings=True),
            "Qwen3MoeForCausalLM": dict(model_type="qwen3_moe", **(tiny | dict(num_hidden_layers=3)), head_dim=32,
                                        intermediate_size=128, moe_intermediate_size=48, num_experts=8,
                                        num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1],
                                        tie_word_embeddings=False),
            "Qwen3MoeForCausalLM-renormalized-sparse-step": dict(
                model_type="qwen3_moe", **tiny, head_dim=16, intermediate_size=128, moe_intermediate_size=48,
                num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2,
                tie_word_embeddings=True),
            "Qwen2MoeForCausalLM": dict(model_type="qwen2_moe", **tiny, intermediate_size=128,
                                        moe_intermediate_size=48, shared_expert_intermediate_size=80,
                                        num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
        }
