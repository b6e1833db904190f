"""Mamba2 (``Mamba2ForCausalLM``): embeddings, blocks of RMSNorm -> Mamba2 mixer with the
residual stream beside them, a final norm and a tied or untied LM head. Every layer keeps a
conv + SSM state per request (``AttentionKind.state``) and nothing per token, so the engine
runs it with no paged cache at all. Parameter names are Hugging Face's (``backbone.*``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.interfaces import AttentionKind, KVLayout, Model
from engine.layers import (
    Layer,
    LayerOps,
    Mamba2Mixer,
    Mamba2Shape,
    RMSNorm,
    VocabEmbedding,
    decoder_rename,
    load_checkpoint,
)


def mamba2_shape(cfg) -> Mamba2Shape:
    return Mamba2Shape(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        state_size=cfg.state_size,
        n_groups=cfg.n_groups,
        conv_kernel=cfg.conv_kernel,
        chunk_size=cfg.chunk_size,
        eps=cfg.layer_norm_epsilon,
        conv_bias=cfg.use_conv_bias,
        proj_bias=cfg.use_bias,
        dt_limit=tuple(cfg.time_step_limit),
    )


class Mamba2Block(Layer):
    """norm -> mixer; (hidden, residual) in and out, the norm adding the stream in."""

    def __init__(self, shape: Mamba2Shape, layer: int, method, dtype, ops: LayerOps):
        super().__init__()
        self.norm = RMSNorm(shape.hidden_size, shape.eps, dtype, ops)
        self.mixer = Mamba2Mixer(shape, layer, method, dtype, ops)

    def forward(self, hidden, residual, step):
        if residual is None:
            hidden, residual = self.norm(hidden), hidden
        else:
            hidden, residual = self.norm(hidden, residual)
        return self.mixer(hidden, step), residual


class Mamba2Backbone(Layer):
    def __init__(self, cfg, shape: Mamba2Shape, method, dtype, ops: LayerOps):
        super().__init__()
        self.embeddings = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, method, dtype)
        self.layers = nn.ModuleList(
            Mamba2Block(shape, i, method, dtype, ops) for i in range(cfg.num_hidden_layers)
        )
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, dtype, ops)

    def forward(self, input_ids, step):
        hidden, residual = self.embeddings(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, step)
        hidden, _ = self.norm_f(hidden, residual)
        return hidden


class Mamba2ForCausalLM(Model):
    architectures = ("Mamba2ForCausalLM",)

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg = self.cfg = ctx.hf_config
        self.shape = mamba2_shape(cfg)
        ops = ctx.layer_ops or LayerOps()
        self.backbone = Mamba2Backbone(cfg, self.shape, ctx.linear_method, ctx.dtype, ops)
        self.tied = getattr(cfg, "tie_word_embeddings", False)
        if not self.tied:
            self.lm_head = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.linear_method, ctx.dtype)
            self.lm_head.serves_lookups = False
        (self.backbone.embeddings if self.tied else self.lm_head).serves_logits = True

    @classmethod
    def supports(cls, hf_config) -> list[str]:
        return mixer_reasons(
            hf_config.num_heads * hf_config.head_dim, hf_config.expand * hf_config.hidden_size
        )

    @classmethod
    def example_configs(cls) -> dict[str, dict]:
        """Two layers, groups of heads sharing B and C, a chunk shorter than the prompts (the
        chunked scan crosses chunks), untied head."""
        return {
            "Mamba2ForCausalLM": dict(
                model_type="mamba2",
                vocab_size=256,
                hidden_size=64,
                num_heads=8,
                head_dim=16,
                expand=2,
                state_size=16,
                n_groups=2,
                conv_kernel=4,
                chunk_size=8,
                num_hidden_layers=2,
                tie_word_embeddings=False,
            )
        }

    def kv_layout(self) -> KVLayout:
        """No attention: every layer keeps its state (the head fields are placeholders)."""
        layers = self.cfg.num_hidden_layers
        return KVLayout(layers, 1, 1, 1, (AttentionKind(state=self.shape.state),) * layers)

    def forward(self, input_ids, positions, step):
        return self.backbone(input_ids, step)

    def compute_logits(self, hidden):
        head = self.backbone.embeddings if self.tied else self.lm_head
        logits = head.logits(hidden)
        return None if logits is None else logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint(self, weights, decoder_rename(self.tied))


def mixer_reasons(heads_width: int, expanded: int) -> list[str]:
    """A mixer whose heads do not span the expanded width is not Mamba2 as transformers runs it."""
    if heads_width != expanded:
        return [f"num_heads · head_dim ({heads_width}) differs from expand · hidden_size ({expanded})"]
    return []
