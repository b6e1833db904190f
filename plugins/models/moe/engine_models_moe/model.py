"""Mixture-of-experts decoders: Mixtral, Qwen3-MoE and Qwen2-MoE on the core's decoder.

Attention is the core's :class:`engine.layers.DecoderAttention` (fused QKV, GQA, RoPE), with
Qwen3-MoE's per-head RMSNorm on q and k before the rotation and Qwen2-MoE's QKV bias. The
feed-forward of a sparse layer is the core's :class:`engine.layers.FusedMoE` (stacked
experts, one grouped matmul per projection) behind a router kept unquantized; Qwen2-MoE adds
a shared expert scaled by a sigmoid gate; the Qwen families' ``mlp_only_layers`` and
``decoder_sparse_step`` give dense layers. Parameter names follow Hugging Face's, so
checkpoints (experts stored one per tensor) load as they are; Mixtral's sparse block,
``block_sparse_moe``, loads as the layer's ``mlp``.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import torch

from engine.layers import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderLayer,
    FusedMoE,
    GatedMLP,
    Layer,
    LayerOps,
    router_linear,
)


@attrs.frozen
class Family:
    """How one architecture's config and checkpoint spell the same model."""

    num_experts_key: str
    expert_size_key: str  # each expert's intermediate size
    qk_norm: bool
    qkv_bias: bool

    def renormalize(self, cfg) -> bool:
        return getattr(cfg, "norm_topk_prob", True)  # Mixtral always renormalizes (and has no such key)

    def is_sparse(self, cfg, layer: int) -> bool:
        return (
            layer not in (getattr(cfg, "mlp_only_layers", None) or [])
            and getattr(cfg, self.num_experts_key) > 0
            and (layer + 1) % getattr(cfg, "decoder_sparse_step", 1) == 0
        )


FAMILIES = {
    "mixtral": Family("num_local_experts", "intermediate_size", qk_norm=False, qkv_bias=False),
    "qwen3_moe": Family("num_experts", "moe_intermediate_size", qk_norm=True, qkv_bias=False),
    "qwen2_moe": Family("num_experts", "moe_intermediate_size", qk_norm=False, qkv_bias=True),
}


class SparseMoeBlock(Layer):
    """Router + experts (+ Qwen2-MoE's gated shared expert, when the config sizes one)."""

    def __init__(self, cfg, family: Family, method, dtype, ops: LayerOps):
        super().__init__()
        num_experts = getattr(cfg, family.num_experts_key)
        shared = getattr(cfg, "shared_expert_intermediate_size", 0)
        self.gate = router_linear(cfg.hidden_size, num_experts, method, dtype)
        self.experts = FusedMoE(
            num_experts,
            cfg.num_experts_per_tok,
            cfg.hidden_size,
            getattr(cfg, family.expert_size_key),
            family.renormalize(cfg),
            method,
            dtype,
            ops,
            reduce_results=not shared,  # with a shared expert, both are reduced in one sum
        )
        if shared:
            self.shared_expert = GatedMLP(
                cfg.hidden_size, shared, False, method, dtype, ops, reduce_results=False
            )
            self.shared_expert_gate = router_linear(cfg.hidden_size, 1, method, dtype)

    def forward(self, x):
        out = self.experts(x, self.gate(x))
        if hasattr(self, "shared_expert"):
            gated = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
            out = self.experts.with_shared(out, gated)
        return out


class MoeForCausalLM(DecoderForCausalLM):
    """Under tensor parallelism attention splits by kv-head groups, dense layers and the shared
    expert as dense MLPs, and the routed experts by intermediate slice (the router replicated)."""

    architectures = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
    tensor_parallel_capable = True

    def decoder_layer(self, cfg, index: int, method, dtype, ops: LayerOps) -> Layer:
        family = FAMILIES[cfg.model_type]
        bias = getattr(cfg, "attention_bias", False)
        attention = DecoderAttention(
            cfg,
            index,
            method,
            dtype,
            ops,
            qkv_bias=family.qkv_bias or bias,
            o_bias=bias,
            qk_norm=family.qk_norm,
        )
        if family.is_sparse(cfg, index):
            mlp = SparseMoeBlock(cfg, family, method, dtype, ops)
        else:
            mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, False, method, dtype, ops)
        return DecoderLayer(attention, mlp, cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(
            (name.replace(".block_sparse_moe.", ".mlp."), tensor) for name, tensor in weights
        )

    @classmethod
    def supports(cls, hf_config) -> list[str]:
        if hf_config.model_type not in FAMILIES:
            return [f"model_type {hf_config.model_type!r} is not one of {sorted(FAMILIES)}"]
        reasons = []
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            reasons.append(f"hidden_act {hf_config.hidden_act!r}: the experts are SwiGLU (silu) only")
        windowed = (
            getattr(hf_config, "use_sliding_window", False)
            if hf_config.model_type != "mixtral"
            else getattr(hf_config, "sliding_window", None)
        )
        if windowed:
            reasons.append("sliding-window attention is not supported")
        return reasons

    @classmethod
    def example_configs(cls) -> dict[str, dict]:
        tiny = dict(
            vocab_size=256,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
        return {
            "MixtralForCausalLM": dict(
                model_type="mixtral",
                **tiny,
                intermediate_size=96,
                num_local_experts=4,
                num_experts_per_tok=2,
                tie_word_embeddings=False,
            ),
            "MixtralForCausalLM-top1-tied": dict(
                model_type="mixtral",
                **tiny,
                intermediate_size=96,
                num_local_experts=8,
                num_experts_per_tok=1,
                tie_word_embeddings=True,
            ),
            "Qwen3MoeForCausalLM": dict(
                model_type="qwen3_moe",
                **(tiny | dict(num_hidden_layers=3)),
                head_dim=32,
                intermediate_size=128,
                moe_intermediate_size=48,
                num_experts=8,
                num_experts_per_tok=2,
                norm_topk_prob=False,
                mlp_only_layers=[1],
                tie_word_embeddings=False,
            ),
            "Qwen3MoeForCausalLM-renormalized-sparse-step": dict(
                model_type="qwen3_moe",
                **tiny,
                head_dim=16,
                intermediate_size=128,
                moe_intermediate_size=48,
                num_experts=4,
                num_experts_per_tok=2,
                norm_topk_prob=True,
                decoder_sparse_step=2,
                tie_word_embeddings=True,
            ),
            "Qwen2MoeForCausalLM": dict(
                model_type="qwen2_moe",
                **tiny,
                intermediate_size=128,
                moe_intermediate_size=48,
                shared_expert_intermediate_size=80,
                num_experts=4,
                num_experts_per_tok=2,
                tie_word_embeddings=False,
            ),
        }
