"""Gemma 2 and Gemma 3 (text): Llama's skeleton with Gemma's differences — embeddings scaled
by sqrt(hidden), ``(1 + w)`` RMSNorms (weights stored as offsets from one), a norm after
attention and around the MLP, GeGLU (tanh gelu), queries scaled by ``query_pre_attn_scalar``,
sliding-window layers beside global ones (``config.layer_types``), attention logits soft-capped
(Gemma 2) and the final logits soft-capped. Gemma 3 adds per-head RMSNorm on q and k before
rotary and a rope base of its own for the local layers. Parameter names are Hugging Face's."""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
import torch.nn.functional as F
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

SLIDING = "sliding_attention"


def layer_types(cfg) -> list[str]:
    """Each layer's attention: ``config.layer_types``, else the family's default pattern
    (Gemma 2: every other layer from the first slides; Gemma 3: five sliding, one global)."""
    types = getattr(cfg, "layer_types", None)
    if types:
        return list(types)
    pattern = 2 if cfg.model_type == "gemma2" else getattr(cfg, "sliding_window_pattern", 6)
    return [SLIDING if (i + 1) % pattern else "full_attention" for i in range(cfg.num_hidden_layers)]


def rope_config(cfg, layer_type: str):
    """A view of ``cfg`` with one layer type's rope parameters (Gemma 3 keeps one set per type)."""
    params = getattr(cfg, "rope_parameters", None)
    if not (isinstance(params, dict) and layer_type in params):
        return cfg
    view = copy.copy(cfg)
    view.rope_parameters = dict(params[layer_type])
    return view


class GemmaRMSNorm(RMSNorm):
    """Gemma's norm multiplies by ``1 + w``: the checkpoint's offsets become plain weights once loaded."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, ops: LayerOps | None = None):
        super().__init__(hidden_size, eps, dtype, ops)
        self.weight.data.zero_()

    def process_weights_after_loading(self) -> None:
        self.weight.data = (1.0 + self.weight.data.float()).to(self.weight.dtype)
        super().process_weights_after_loading()


class GemmaAttention(Layer):
    def __init__(self, cfg, layer: int, method, dtype, ops: LayerOps):
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        bias = getattr(cfg, "attention_bias", False)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [q_size, kv_size, kv_size], bias, method, dtype)
        self.o_proj = Linear(q_size, [cfg.hidden_size], bias, method, dtype)
        self.qk_norm = cfg.model_type == "gemma3_text"
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, ops)
            self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, ops)
        self.attn = Attention(layer)

    def forward(self, cos_sin, hidden, step):
        qkv, heads = self.qkv_proj(hidden), (self.num_heads, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k, v = self.ops.qk_norm_rotary(qkv, self.q_norm, self.k_norm, *heads, cos_sin)
        else:
            q, k, v = self.ops.rotary_qkv(qkv, *heads, cos_sin)
        out = self.attn(q, k, v, step)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class GemmaMLP(Layer):
    def __init__(self, cfg, method, dtype):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, [cfg.intermediate_size] * 2, False, method, dtype)
        self.down_proj = Linear(cfg.intermediate_size, [cfg.hidden_size], False, method, dtype)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(Layer):
    """The residual add is fused into the next norm (as in Llama): a layer takes and returns
    (hidden, residual), the stream being their sum."""

    def __init__(self, cfg, layer: int, method, dtype, ops: LayerOps):
        super().__init__()
        self.layer_type = layer_types(cfg)[layer]
        norm = lambda: GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = GemmaAttention(cfg, layer, method, dtype, ops)
        self.mlp = GemmaMLP(cfg, method, dtype)

    def forward(self, cos_sin, hidden, residual, step):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(cos_sin[self.layer_type], hidden, step))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(Layer):
    def __init__(self, cfg, method, dtype, ops: LayerOps):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, method, dtype)
        self.embed_scale = cfg.hidden_size**0.5
        self.rotary = nn.ModuleDict(
            {
                kind: RotaryEmbedding(rope_config(cfg, kind), cfg.max_position_embeddings, dtype)
                for kind in dict.fromkeys(layer_types(cfg))
            }
        )
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, i, method, dtype, ops) for i in range(cfg.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)

    def embed(self, input_ids):
        embedded = self.embed_tokens(input_ids)
        return embedded * torch.tensor(
            self.embed_scale, dtype=embedded.dtype
        )  # rounded first, as in transformers

    def forward(self, input_ids, positions, step):
        hidden, residual = self.embed(input_ids), None
        cos_sin = {kind: rotary(positions) for kind, rotary in self.rotary.items()}
        for layer in self.layers:
            hidden, residual = layer(cos_sin, hidden, residual, step)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class GemmaForCausalLM(Model):
    architectures = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg = ctx.hf_config
        self.cfg = cfg
        self.model = GemmaModel(cfg, ctx.linear_method, ctx.dtype, ctx.layer_ops or LayerOps())
        self.tied = getattr(cfg, "tie_word_embeddings", True)
        if not self.tied:
            self.lm_head = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.linear_method, ctx.dtype)
            self.lm_head.serves_lookups = False
        (self.model.embed_tokens if self.tied else self.lm_head).serves_logits = True
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)

    @classmethod
    def supports(cls, hf_config) -> list[str]:
        reasons = []
        if getattr(hf_config, "use_bidirectional_attention", False):
            reasons.append("bidirectional attention (an embedding model) is not supported")
        if getattr(hf_config, "hidden_activation", "gelu_pytorch_tanh") not in (
            "gelu_pytorch_tanh",
            "gelu_tanh",
        ):
            reasons.append(f"hidden_activation {hf_config.hidden_activation!r} is not supported")
        return reasons

    @classmethod
    def example_configs(cls) -> dict[str, dict]:
        tiny = dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            sliding_window=16,
            query_pre_attn_scalar=24,
            attn_implementation="eager",
        )
        return {
            "Gemma2ForCausalLM": dict(
                model_type="gemma2",
                **tiny,
                num_hidden_layers=4,
                attn_logit_softcapping=5.0,
                final_logit_softcapping=3.0,
            ),
            "Gemma2ForCausalLM-untied-mha": dict(
                model_type="gemma2",
                **{**tiny, "num_key_value_heads": 4},
                num_hidden_layers=2,
                tie_word_embeddings=False,
                attn_logit_softcapping=5.0,
                final_logit_softcapping=None,
            ),
            "Gemma3ForCausalLM": dict(
                model_type="gemma3_text",
                **tiny,
                num_hidden_layers=3,
                layer_types=[SLIDING, SLIDING, "full_attention"],
                rope_parameters={
                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                    SLIDING: {"rope_type": "default", "rope_theta": 1e4},
                },
                final_logit_softcapping=3.0,
            ),
            "Gemma3ForCausalLM-untied": dict(
                model_type="gemma3_text",
                **tiny,
                num_hidden_layers=2,
                layer_types=[SLIDING, "full_attention"],
                tie_word_embeddings=False,
                final_logit_softcapping=None,
            ),
        }

    def kv_layout(self) -> KVLayout:
        cfg = self.cfg
        softcap = getattr(cfg, "attn_logit_softcapping", None)
        scale = cfg.query_pre_attn_scalar**-0.5
        kinds = tuple(
            AttentionKind(cfg.sliding_window if kind == SLIDING else None, softcap, scale)
            for kind in layer_types(cfg)
        )
        return KVLayout(
            cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, kinds
        )

    def forward(self, input_ids, positions, step):
        return self.model(input_ids, positions, step)

    def embed(self, input_ids):
        return self.model.embed(input_ids)

    def compute_logits(self, hidden):
        head = self.model.embed_tokens if self.tied else self.lm_head
        logits = head.logits(hidden).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint(self, weights, decoder_rename(self.tied))
