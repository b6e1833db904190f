"""Bamba (``BambaForCausalLM``, IBM's Mamba2 + attention hybrid) on the core's pre-norm decoder
(:class:`engine.layers.DecoderForCausalLM`): each layer is norm -> a Mamba2 mixer or Llama's
attention (``attn_layer_indices``; rotary over half of each head) -> norm -> SwiGLU MLP. Mamba
layers keep a conv + SSM state per request in a state group; attention layers cache K/V in
pages; one budget holds both. Checkpoint names are Hugging Face's, renamed onto the shared
decoder's (``mamba`` -> ``self_attn``, ``feed_forward`` -> ``mlp``, ``pre_ff_layernorm`` ->
``post_attention_layernorm``, ``final_layernorm`` -> ``norm``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.interfaces import AttentionKind
from engine.layers import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderLayer,
    GatedMLP,
    Mamba2Mixer,
    Mamba2Shape,
    decoder_rename,
    load_checkpoint,
)
from engine_models_mamba_hybrid.mamba2 import mixer_reasons

RENAMES = (
    (".mamba.", ".self_attn."),
    (".feed_forward.", ".mlp."),
    (".pre_ff_layernorm.", ".post_attention_layernorm."),
    ("model.final_layernorm.", "model.norm."),
)


class DecoderMamba2Mixer(Mamba2Mixer):
    """A Mamba2 mixer where the decoder layer places its attention (it ignores the rotary tables)."""

    def forward(self, cos_sin, hidden, step):  # type: ignore[override]
        return super().forward(hidden, step)


def bamba_shape(cfg) -> Mamba2Shape:
    return Mamba2Shape(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.mamba_n_heads,
        head_dim=cfg.mamba_d_head,
        state_size=cfg.mamba_d_state,
        n_groups=cfg.mamba_n_groups,
        conv_kernel=cfg.mamba_d_conv,
        chunk_size=cfg.mamba_chunk_size,
        eps=cfg.rms_norm_eps,
        conv_bias=cfg.mamba_conv_bias,
        proj_bias=cfg.mamba_proj_bias,
        dt_limit=tuple(cfg.time_step_limit),
    )


class BambaForCausalLM(DecoderForCausalLM):
    architectures = ("BambaForCausalLM",)

    def decoder_layer(self, cfg, index, method, dtype, ops):
        if index in (cfg.attn_layer_indices or ()):
            bias = cfg.attention_bias
            mixer = DecoderAttention(cfg, index, method, dtype, ops, qkv_bias=bias, o_bias=bias)
        else:
            mixer = DecoderMamba2Mixer(bamba_shape(cfg), index, method, dtype, ops)
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, method, dtype, ops)
        return DecoderLayer(mixer, mlp, cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)

    def layer_kinds(self) -> tuple[AttentionKind, ...]:
        """Attention layers plain, Mamba layers keeping their state."""
        attention, state = AttentionKind(), AttentionKind(state=bamba_shape(self.cfg).state)
        attending = set(self.cfg.attn_layer_indices or ())
        return tuple(attention if i in attending else state for i in range(self.cfg.num_hidden_layers))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        untied = decoder_rename(self.tied)

        def rename(name: str) -> str | None:
            for old, new in RENAMES:
                name = name.replace(old, new)
            return untied(name)

        load_checkpoint(self, weights, rename)

    @classmethod
    def supports(cls, hf_config) -> list[str]:
        reasons = mixer_reasons(
            hf_config.mamba_n_heads * hf_config.mamba_d_head, hf_config.mamba_expand * hf_config.hidden_size
        )
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            reasons.append(f"hidden_act {hf_config.hidden_act!r} is not supported (SwiGLU only)")
        return reasons

    @classmethod
    def example_configs(cls) -> dict[str, dict]:
        """Four layers, attention at 1 and 3 (GQA, rotary over half of each head), Mamba2 at
        0 and 2 with groups of heads and a chunk shorter than the prompts."""
        return {
            "BambaForCausalLM": dict(
                model_type="bamba",
                vocab_size=256,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=4,
                attn_layer_indices=[1, 3],
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=256,
                mamba_n_heads=8,
                mamba_d_head=16,
                mamba_expand=2,
                mamba_d_state=16,
                mamba_n_groups=2,
                mamba_d_conv=4,
                mamba_chunk_size=8,
                tie_word_embeddings=False,
            )
        }
