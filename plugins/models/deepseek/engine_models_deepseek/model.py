"""DeepSeek-V2 and DeepSeek-V3 on the core's decoder, with multi-head latent attention (MLA).

Attention (:class:`LatentSelfAttention`): the query comes from ``q_proj`` (V2-Lite) or the
low-rank ``q_a_proj`` → RMSNorm → ``q_b_proj`` (V2, V3); ``kv_a_proj_with_mqa`` gives per token
the KV latent (normalized by ``kv_a_layernorm``) and one rotary key part shared by all heads.
Those two are all the cache holds — the layer declares the paged latent layout
(``AttentionKind.latent``, models interface v3) — and the attention backend gets the per-head
up-projection ``kv_b_proj`` to attend with (decompressed for prefill, absorbed for decode: the
backend's choice). The rotary part is YaRN-scaled as ``rope_parameters`` say (through the core's
tables), and its pairs are interleaved in the checkpoint (V2 always, V3 with ``rope_interleave``):
they are de-interleaved before the rotate-half rotation, which leaves every q·k product as Hugging
Face's. The softmax scale is 1/√(qk head dim) times YaRN's ``mscale(factor, mscale_all_dim)²``.

Feed-forward: the first ``first_k_dense_replace`` layers are dense SwiGLU; the others are the
core's :class:`engine.layers.FusedMoE` under DeepSeek's router (:mod:`.routing`) plus
``n_shared_experts`` shared experts as one SwiGLU every token goes through.

Tensor parallelism (as vLLM splits MLA): the attention heads split evenly over the ranks
(:func:`rank_heads`). A rank holds its heads' rows of the query projection (``q_proj`` or
``q_b_proj``) and of ``kv_b_proj``, and its heads' columns of ``o_proj``, which all-reduces;
``q_a_proj`` and its norm, the latent projection ``kv_a_proj_with_mqa``, its norm and the rotary
key are replicated, so every rank computes and caches the same latent pages, and attends them
with its own heads. Dense layers and the shared experts split as dense MLPs, the routed experts
by intermediate slice (the core's FusedMoE), the router replicated.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from engine.distributed import TensorParallel, current_tensor_parallel
from engine.interfaces import AttentionKind, KVLayout, LatentUpProjection, PagedLatent
from engine.layers import (
    DecoderForCausalLM,
    DecoderLayer,
    FusedMoE,
    GatedMLP,
    LatentAttention,
    Layer,
    LayerOps,
    Linear,
    RMSNorm,
    decoder_rename,
    load_checkpoint,
)
from engine.layers.checkpoint import narrow_rows
from engine.layers.parallel import ColumnParallelLinear, RowParallelLinear
from engine_models_deepseek.routing import DeepseekRouter

# the low-rank projections' own norms use Hugging Face's default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6
# checkpoint projections fused on load: the MLPs' gate and up (q_proj is not fused here)
MLP_PROJECTIONS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
V3 = "deepseek_v3"
MTP_ARCHITECTURE = "DeepSeekMTPModel"  # vLLM's name for V3's multi-token-prediction module


def yarn_mscale(factor: float, mscale: float) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def softmax_scale(cfg) -> float:
    """1/√(qk head dim), times YaRN's mscale² where the rope parameters set ``mscale_all_dim``."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    return scale


def rope_interleaved(cfg) -> bool:
    """Whether the checkpoint's rotary dims come in (x0, x1), (x2, x3) ... pairs."""
    return cfg.model_type != V3 or getattr(cfg, "rope_interleave", True)


def rank_heads(cfg, tp: TensorParallel) -> tuple[int, int]:
    """(first head, heads) of the attention heads rank ``tp.rank`` holds: an even split."""
    return tp.split(cfg.num_attention_heads, "num_attention_heads")


def up_projection_rows(weights, cfg, tp: TensorParallel):
    """``weights`` with each ``kv_b_proj.weight`` cut to this rank's heads' rows (each head's key
    and value rows are contiguous, nope + v of them): the rest passes untouched."""
    start, heads = rank_heads(cfg, tp)
    per_head = cfg.qk_nope_head_dim + cfg.v_head_dim
    for name, tensor in weights:
        if tp.size > 1 and name.endswith("kv_b_proj.weight"):
            tensor = narrow_rows(tensor, start * per_head, heads * per_head)
        yield name, tensor


def rotate(x: torch.Tensor, cos_sin, interleaved: bool) -> torch.Tensor:
    """x [T, heads, D] rotated with the core's rotate-half tables ([cos, cos], [−sin, sin])."""
    if interleaved:
        x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    cos, sin = cos_sin
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin


class UpProjection(Layer):
    """``kv_b_proj``: the latent's up-projection to each head's key (without rotary part) and
    value, [H · (nope + v), kv_lora_rank], kept dense in the activation dtype (the attention
    backend folds it into queries and outputs; vLLM dequantizes it for the same reason)."""

    def __init__(self, heads: int, nope: int, value: int, rank: int, dtype: torch.dtype):
        super().__init__()
        self.heads, self.nope = heads, nope
        self.weight = nn.Parameter(
            torch.zeros(heads * (nope + value), rank, dtype=dtype), requires_grad=False
        )

    def per_head(self) -> LatentUpProjection:
        w = self.weight.view(self.heads, -1, self.weight.shape[1])
        return LatentUpProjection(w[:, : self.nope], w[:, self.nope :])


class LatentSelfAttention(Layer):
    """MLA over this rank's heads (``heads``: all of them on one rank)."""

    def __init__(self, cfg, layer: int, method, dtype, ops: LayerOps):
        super().__init__()
        first, self.heads = rank_heads(cfg, current_tensor_parallel())
        self.rank = cfg.kv_lora_rank
        self.nope, self.rope, self.value = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.interleaved = rope_interleaved(cfg)
        head, bias = self.nope + self.rope, cfg.attention_bias
        q_size, q_shard = cfg.num_attention_heads * head, [(first * head, self.heads * head)]
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(cfg.hidden_size, [cfg.q_lora_rank], bias, method, dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, dtype, ops)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, [q_size], False, method, dtype, q_shard)
        else:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, [q_size], False, method, dtype, q_shard)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, [self.rank + self.rope], bias, method, dtype)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS, dtype, ops)
        self.kv_b_proj = UpProjection(self.heads, self.nope, self.value, self.rank, dtype)
        o_shard = (first * self.value, self.heads * self.value)
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * self.value, cfg.hidden_size, bias, method, dtype, o_shard
        )
        self.attn = LatentAttention(layer)

    def _query(self, hidden: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(hidden)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))

    def forward(self, cos_sin, hidden, step):
        tokens = hidden.shape[0]
        q = self._query(hidden).view(tokens, self.heads, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_rope = rotate(q_rope, cos_sin, self.interleaved)
        k_rope = rotate(k_rope[:, None], cos_sin, self.interleaved)[:, 0]
        out = self.attn(q_nope, q_rope, latent, k_rope, self.kv_b_proj.per_head(), step)
        return self.o_proj(out.reshape(tokens, self.heads * self.value))


class DeepseekMoE(Layer):
    """Routed experts under DeepSeek's router, plus the shared experts every token takes."""

    def __init__(self, cfg, method, dtype, ops: LayerOps):
        super().__init__()
        num_experts = cfg.n_routed_experts
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.gate = DeepseekRouter(cfg, num_experts, v3=cfg.model_type == V3)
        self.experts = FusedMoE(
            num_experts,
            cfg.num_experts_per_tok,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            False,
            method,
            dtype,
            ops,
            reduce_results=not shared,  # with shared experts, both are reduced in one sum
        )
        self.shared_experts = (
            GatedMLP(cfg.hidden_size, shared, False, method, dtype, ops, reduce_results=False)
            if shared
            else None
        )

    def forward(self, x):
        out = self.experts.apply_routing(x, *self.gate(x))
        return out if self.shared_experts is None else self.experts.with_shared(out, self.shared_experts(x))


def deepseek_layer(cfg, index: int, cache_layer: int, method, dtype, ops: LayerOps) -> DecoderLayer:
    """Checkpoint layer ``index`` (dense below ``first_k_dense_replace``, else MoE), attending
    through cache layer ``cache_layer``."""
    attention = LatentSelfAttention(cfg, cache_layer, method, dtype, ops)
    if index >= cfg.first_k_dense_replace and cfg.n_routed_experts:
        mlp: Layer = DeepseekMoE(cfg, method, dtype, ops)
    else:
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, False, method, dtype, ops)
    return DecoderLayer(attention, mlp, cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)


def latent_kv_layout(cfg, layers: int, tp: TensorParallel) -> KVLayout:
    """``layers`` MLA layers, each caching one ``kv_lora_rank + qk_rope_head_dim`` latent per token
    (the same on every rank) and attended by the rank's heads."""
    kind = AttentionKind(
        query_scale=softmax_scale(cfg), latent=PagedLatent(cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    )
    head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    return KVLayout(layers, rank_heads(cfg, tp)[1], 1, head, (kind,) * layers)


class DeepseekForCausalLM(DecoderForCausalLM):
    architectures = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
    tensor_parallel_capable = True  # MLA split by heads, MLPs and experts as the core splits them

    def decoder_layer(self, cfg, index: int, method, dtype, ops: LayerOps) -> Layer:
        return deepseek_layer(cfg, index, index, method, dtype, ops)

    def kv_layout(self) -> KVLayout:
        return latent_kv_layout(self.cfg, self.cfg.num_hidden_layers, self.tensor_parallel)

    @classmethod
    def mtp_architecture(cls, hf_config) -> str | None:
        """V3 checkpoints with ``num_nextn_predict_layers`` carry an MTP module (:mod:`.mtp`)."""
        if hf_config.model_type == V3 and getattr(hf_config, "num_nextn_predict_layers", 0):
            return MTP_ARCHITECTURE
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face's names; V3's multi-token-prediction layers (``model.layers.<N>`` past
        the last, N = num_hidden_layers) are skipped: they are a drafter's (:mod:`.mtp`)."""
        base, mtp = decoder_rename(self.tied), f"model.layers.{self.cfg.num_hidden_layers}."
        load_checkpoint(
            self,
            up_projection_rows(weights, self.cfg, self.tensor_parallel),
            lambda name: None if name.startswith(mtp) else base(name),
            fused=MLP_PROJECTIONS,
        )

    @classmethod
    def supports(cls, hf_config) -> list[str]:
        reasons = []
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            reasons.append(f"hidden_act {hf_config.hidden_act!r}: the MLPs are SwiGLU (silu) only")
        method = getattr(hf_config, "topk_method", None)
        if hf_config.model_type != V3 and method not in ("greedy", "group_limited_greedy"):
            reasons.append(f"topk_method {method!r} is not greedy or group_limited_greedy")
        grouped = hf_config.model_type == V3 or method == "group_limited_greedy"
        groups = getattr(hf_config, "n_group", None)
        if grouped and (not groups or hf_config.n_routed_experts % groups):
            reasons.append(f"n_group {groups!r} does not divide {hf_config.n_routed_experts} routed experts")
        return reasons

    @classmethod
    def example_configs(cls) -> dict[str, dict]:
        tiny = dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            max_position_embeddings=256,
            first_k_dense_replace=1,
            tie_word_embeddings=False,
        )
        yarn = dict(
            rope_type="yarn",
            rope_theta=5000.0,
            factor=4.0,
            original_max_position_embeddings=64,
            beta_fast=32,
            beta_slow=1,
            mscale=0.707,
            mscale_all_dim=0.707,
        )
        return {
            # V2-Lite's shape: no query low rank, softmax greedy routing, two shared experts
            "DeepseekV2ForCausalLM": dict(
                model_type="deepseek_v2",
                **tiny,
                q_lora_rank=None,
                n_routed_experts=8,
                n_shared_experts=2,
                num_experts_per_tok=2,
                topk_method="greedy",
                routed_scaling_factor=1.0,
            ),
            # V2's: query low rank, group-limited greedy routing with a scaling factor, YaRN
            "DeepseekV2ForCausalLM-grouped-yarn": dict(
                model_type="deepseek_v2",
                **tiny,
                q_lora_rank=24,
                n_routed_experts=8,
                n_shared_experts=1,
                num_experts_per_tok=2,
                topk_method="group_limited_greedy",
                n_group=4,
                topk_group=2,
                routed_scaling_factor=1.5,
                rope_parameters=yarn,
            ),
            # V3's: sigmoid scores, biased grouped choice, renormalized and scaled weights, YaRN
            "DeepseekV3ForCausalLM": dict(
                model_type="deepseek_v3",
                **tiny,
                q_lora_rank=24,
                n_routed_experts=8,
                n_shared_experts=1,
                num_experts_per_tok=3,
                n_group=4,
                topk_group=2,
                norm_topk_prob=True,
                routed_scaling_factor=2.5,
                rope_interleave=True,
                rope_parameters=yarn,
            ),
        }
