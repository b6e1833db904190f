"""BERT as an embedding model: absolute position embeddings plus the token-type-0 row,
post-LayerNorm encoder layers (fused QKV projection, bidirectional attention through the
engine's attention backend, GELU MLP), no LM head. The engine pools its final hidden states
(CLS by default, as vLLM's BERT embedding model; ``--pooler-config`` overrides). Module and
parameter names follow Hugging Face's ``BertModel`` so checkpoints load as they are; the
checkpoint's own pooler layer (dense + tanh over CLS) is not what sentence embeddings use and
is skipped, as vLLM does."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from engine.interfaces import KVLayout, Model
from engine.layers import Attention, Layer, Linear, VocabEmbedding, load_checkpoint

QKV = {"query": ("qkv_proj", 0), "key": ("qkv_proj", 1), "value": ("qkv_proj", 2)}


class LayerNorm(Layer):
    def __init__(self, size: int, eps: float, dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size, dtype=dtype), requires_grad=False)

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class BertEmbeddings(Layer):
    """Word + absolute position + token type embeddings, LayerNormed. ``position_offset``: the
    first position's row (RoBERTa's positions start after its padding index)."""

    def __init__(self, cfg, method, dtype, position_offset: int = 0):
        super().__init__()
        self.position_offset = position_offset
        self.word_embeddings = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, method, dtype)
        self.position_embeddings = VocabEmbedding(cfg.max_position_embeddings, cfg.hidden_size, method, dtype)
        self.token_type_embeddings = VocabEmbedding(cfg.type_vocab_size, cfg.hidden_size, method, dtype)
        self.LayerNorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)

    def forward(self, input_ids, positions, token_types=None):
        """``token_types`` [T] (None: every token is type 0, a single-segment input)."""
        types = torch.zeros_like(input_ids[:1]) if token_types is None else token_types
        return self.LayerNorm(
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions + self.position_offset)
            + self.token_type_embeddings(types)
        )


class BertSelfAttention(Layer):
    def __init__(self, cfg, method, dtype):
        super().__init__()
        self.qkv_proj = Linear(cfg.hidden_size, [cfg.hidden_size] * 3, True, method, dtype)


class BertOutput(Layer):
    """A projection back to the hidden size, added to the residual and post-LayerNormed."""

    def __init__(self, cfg, input_size: int, method, dtype):
        super().__init__()
        self.dense = Linear(input_size, [cfg.hidden_size], True, method, dtype)
        self.LayerNorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)

    def forward(self, x, residual):
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(Layer):
    def __init__(self, cfg, layer: int, method, dtype):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.self = BertSelfAttention(cfg, method, dtype)
        self.output = BertOutput(cfg, cfg.hidden_size, method, dtype)
        self.attn = Attention(layer)

    def forward(self, hidden, step):
        shape = (-1, self.num_heads, self.head_dim)
        q, k, v = (t.reshape(shape) for t in self.self.qkv_proj(hidden).chunk(3, dim=-1))
        out = self.attn(q, k, v, step).reshape(hidden.shape)
        return self.output(out, hidden)


class BertIntermediate(Layer):
    def __init__(self, cfg, method, dtype):
        super().__init__()
        self.dense = Linear(cfg.hidden_size, [cfg.intermediate_size], True, method, dtype)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x):
        return self.act(self.dense(x))


class BertLayer(Layer):
    def __init__(self, cfg, layer: int, method, dtype):
        super().__init__()
        self.attention = BertAttention(cfg, layer, method, dtype)
        self.intermediate = BertIntermediate(cfg, method, dtype)
        self.output = BertOutput(cfg, cfg.intermediate_size, method, dtype)

    def forward(self, hidden, step):
        hidden = self.attention(hidden, step)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(Layer):
    def __init__(self, cfg, method, dtype):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg, i, method, dtype) for i in range(cfg.num_hidden_layers))

    def forward(self, hidden, step):
        for layer in self.layer:
            hidden = layer(hidden, step)
        return hidden


def encoder_reasons(hf_config) -> list[str]:
    """Why this plugin's encoder layers cannot serve ``hf_config`` (empty: they can)."""
    reasons = []
    kind = getattr(hf_config, "position_embedding_type", "absolute")
    if kind != "absolute":
        reasons.append(f"position_embedding_type {kind!r} is not supported (absolute only)")
    if getattr(hf_config, "is_decoder", False):
        reasons.append("a BERT decoder (is_decoder) is not supported: this plugin serves encoders")
    if hf_config.hidden_size % hf_config.num_attention_heads:
        reasons.append("hidden_size is not a multiple of num_attention_heads")
    return reasons


def encoder_kv_layout(cfg) -> KVLayout:
    """Bidirectional attention over the whole prompt, one K/V head per query head."""
    heads = cfg.num_attention_heads
    return KVLayout(cfg.num_hidden_layers, heads, heads, cfg.hidden_size // heads, causal=False)


class BertModel(Model):
    architectures = ("BertModel",)
    generative = False
    default_pooling_type = "CLS"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.cfg = cfg = ctx.hf_config
        self.embeddings = BertEmbeddings(cfg, ctx.linear_method, ctx.dtype)
        self.encoder = BertEncoder(cfg, ctx.linear_method, ctx.dtype)

    @classmethod
    def supports(cls, hf_config) -> list[str]:
        return encoder_reasons(hf_config)

    @classmethod
    def example_configs(cls) -> dict[str, dict]:
        return {
            "BertModel": dict(
                model_type="bert",
                vocab_size=256,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=128,
            )
        }

    def kv_layout(self) -> KVLayout:
        return encoder_kv_layout(self.cfg)

    def forward(self, input_ids, positions, step):
        return self.encoder(self.embeddings(input_ids, positions), step)

    def compute_logits(self, hidden):
        raise NotImplementedError("BertModel has no LM head: it only pools (runner='pooling')")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(name: str) -> str | None:
            # the checkpoint's pooler layer is unused; older checkpoints also store position ids
            return None if name.startswith("pooler.") or name.endswith("position_ids") else name

        load_checkpoint(self, weights, rename, fused=QKV)
