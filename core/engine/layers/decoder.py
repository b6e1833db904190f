"""The frame most decoder-only models share, so a model plugin writes only its layers:
:class:`PreNormDecoderLayer` (the residual stream around attention and feed-forward),
:class:`DecoderStack` (token embedding → rotary tables → the layers → final RMSNorm) and
:class:`DecoderForCausalLM` (the stack plus an LM head, tied to the embedding when the config
says). Attribute names are Hugging Face's (``model.embed_tokens``, ``model.layers``,
``model.norm``, ``lm_head``), so checkpoints load by name."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable

import torch
from torch import nn

from engine.interfaces import KVLayout, Model
from engine.layers.embedding import VocabEmbedding
from engine.layers.loading import load_checkpoint
from engine.layers.module import Layer
from engine.layers.norm import RMSNorm
from engine.layers.ops import LayerOps
from engine.layers.rotary import RotaryEmbedding


def head_dim(cfg) -> int:
    """The config's explicit ``head_dim`` (Qwen3 sets one unlike hidden/heads), else hidden/heads."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class PreNormDecoderLayer(Layer):
    """``input_layernorm`` → ``self_attn(cos_sin, hidden, step)`` → ``post_attention_layernorm``
    → :meth:`feed_forward`, the norms adding the residual stream in. A subclass builds those
    modules (and ``mlp``, or overrides :meth:`feed_forward` where its feed-forward has another
    name)."""

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mlp(hidden)

    def forward(self, cos_sin, hidden, residual, step):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(cos_sin, hidden, step)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual


class DecoderStack(Layer):
    """Each of ``layers`` is called ``layer(cos_sin, hidden, residual, step) -> (hidden,
    residual)`` with the residual stream kept apart (``residual`` None before the first);
    after the layers in ``step.aux_layers`` the stream (hidden + residual) is appended to
    ``step.aux_hidden`` (EAGLE-3)."""

    def __init__(self, cfg, layers: Iterable[nn.Module], method, dtype: torch.dtype, ops: LayerOps):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, method, dtype)
        self.rotary = RotaryEmbedding(cfg, cfg.max_position_embeddings, dtype)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)

    def forward(self, input_ids, positions, step, num_layers: int | None = None):
        """Through the first ``num_layers`` layers (default all: a layer-skip drafter asks fewer)."""
        hidden, residual = self.embed_tokens(input_ids), None
        cos_sin = self.rotary(positions)
        for index, layer in enumerate(self.layers[:num_layers]):
            hidden, residual = layer(cos_sin, hidden, residual, step)
            if index in step.aux_layers:
                step.aux_hidden.append(hidden + residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(Model):
    """A :class:`DecoderStack` (from :meth:`build_decoder`) with its LM head; the KV layout is
    one plain attention kind over ``num_hidden_layers`` layers."""

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg = ctx.hf_config
        self.cfg = cfg
        self.model = self.build_decoder(cfg, ctx.linear_method, ctx.dtype, ctx.layer_ops or LayerOps())
        self.tied = getattr(cfg, "tie_word_embeddings", False)
        if not self.tied:
            self.lm_head = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.linear_method, ctx.dtype)

    @abstractmethod
    def build_decoder(self, cfg, method, dtype: torch.dtype, ops: LayerOps) -> DecoderStack:
        """The model body for this config."""

    def kv_layout(self) -> KVLayout:
        cfg = self.cfg
        return KVLayout(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(cfg))

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
