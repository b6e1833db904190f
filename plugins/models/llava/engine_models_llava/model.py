"""LLaVA (``LlavaForConditionalGeneration``): a vision tower (CLIP or SigLIP), a two-layer
projector into the text model's hidden size, and a Llama text model on the core's decoder
layers. The vision tower is ``transformers``' own module, run once per image by the engine's
encoder cache; the text model runs over the flattened token axis like any decoder, its image
placeholder rows' embeddings replaced by the projected image features
(``StepContext.merge_multimodal``). Parameter names are Hugging Face's, in both the original
(``language_model.model.*``) and the ``transformers`` 5 (``model.language_model.*``) layouts."""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import torch
from torch import nn

from engine.interfaces import KVLayout, Model
from engine.layers import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderLayer,
    GatedMLP,
    load_whole,
    route_by_prefix,
)
from engine_models_llava.processor import LlavaImageProcessor

# checkpoint name prefix -> (part, prefix it has inside that part)
_PREFIXES = (
    ("language_model.model.", "text", "model."),
    ("language_model.lm_head.", "text", "lm_head."),
    ("model.language_model.", "text", "model."),
    ("lm_head.", "text", "lm_head."),
    ("vision_tower.", "vision", ""),
    ("model.vision_tower.", "vision", ""),
    ("multi_modal_projector.", "projector", ""),
    ("model.multi_modal_projector.", "projector", ""),
)


class LlavaTextModel(DecoderForCausalLM):
    """The Llama text model (fused QKV and gate|up, GQA, RoPE) on the core's decoder layers."""

    architectures = ()

    def decoder_layer(self, cfg, index, method, dtype, ops):
        bias = getattr(cfg, "attention_bias", False)
        attention = DecoderAttention(cfg, index, method, dtype, ops, qkv_bias=bias, o_bias=bias)
        mlp = GatedMLP(
            cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "mlp_bias", False), method, dtype, ops
        )
        return DecoderLayer(attention, mlp, cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)


class LlavaProjector(nn.Module):
    """Vision features -> text hidden size: linear, activation, linear (HF's names)."""

    def __init__(self, cfg, dtype):
        super().__init__()
        from transformers.activations import ACT2FN

        layers = 1 if isinstance(cfg.vision_feature_layer, int) else len(cfg.vision_feature_layer)
        bias = getattr(cfg, "multimodal_projector_bias", True)
        hidden = cfg.text_config.hidden_size
        self.linear_1 = nn.Linear(cfg.vision_config.hidden_size * layers, hidden, bias=bias, dtype=dtype)
        self.act = ACT2FN[cfg.projector_hidden_act]
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias, dtype=dtype)

    def forward(self, features):
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(Model):
    architectures = ("LlavaForConditionalGeneration",)
    multimodal_processor = LlavaImageProcessor

    def __init__(self, ctx):
        super().__init__(ctx)
        from transformers import AutoModel

        cfg = self.cfg = ctx.hf_config
        self.language_model = LlavaTextModel(attrs.evolve(ctx, hf_config=cfg.text_config))
        # text only (limit_mm_per_prompt {"image": 0}): no vision tower built, its weights skipped
        self.vision_tower = self.multi_modal_projector = None
        if ctx.takes("image"):
            # CLIPVisionModel / SiglipVisionModel (older checkpoints nest it in ``vision_model.``)
            self.vision_tower = AutoModel.from_config(cfg.vision_config).to(ctx.dtype)
            self.multi_modal_projector = LlavaProjector(cfg, ctx.dtype)

    @classmethod
    def supports(cls, hf_config) -> list[str]:
        reasons = []
        if hf_config.text_config.model_type not in ("llama", "mistral", "qwen2"):
            reasons.append(f"text model {hf_config.text_config.model_type!r} (Llama-shaped only)")
        if getattr(hf_config.text_config, "sliding_window", None):
            reasons.append("a sliding-window text model is not supported")
        if hf_config.vision_config.model_type not in ("clip_vision_model", "siglip_vision_model"):
            reasons.append(f"vision tower {hf_config.vision_config.model_type!r} (CLIP or SigLIP only)")
        return reasons

    def kv_layout(self) -> KVLayout:
        return self.language_model.kv_layout()

    def forward(self, input_ids, positions, step):
        return self.language_model(input_ids, positions, step)

    def compute_logits(self, hidden):
        return self.language_model.compute_logits(hidden)

    def embed(self, input_ids):
        return self.language_model.embed(input_ids)

    def encode_multimodal(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's ``pixel_values`` [1, 3, H, W] -> its projected features [tokens, hidden],
        as ``transformers``' ``get_image_features``: the hidden states of
        ``vision_feature_layer`` (or several, concatenated), CLS dropped by the ``default``
        strategy."""
        cfg = self.cfg
        if self.vision_tower is None or self.multi_modal_projector is None:
            raise ValueError("images are off (limit_mm_per_prompt): no vision tower was loaded")
        pixels = data["pixel_values"].to(self.ctx.dtype)
        states = self.vision_tower(pixels, output_hidden_states=True).hidden_states
        layers = (
            [cfg.vision_feature_layer]
            if isinstance(cfg.vision_feature_layer, int)
            else cfg.vision_feature_layer
        )
        chosen = [
            states[i][:, 1:] if cfg.vision_feature_select_strategy == "default" else states[i] for i in layers
        ]
        return self.multi_modal_projector(torch.cat(chosen, dim=-1))[0]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        parts: dict[str, dict[str, torch.Tensor]] = {"vision": {}, "projector": {}}

        def text_weights():
            for name, tensor in weights:
                part, inner = route_by_prefix(name, _PREFIXES, "LLaVA")
                if part == "text":
                    yield inner, tensor
                else:
                    parts[part][inner.removeprefix("vision_model.")] = tensor

        self.language_model.load_weights(text_weights())
        if self.vision_tower is not None and self.multi_modal_projector is not None:
            # SigLIP's pooling head: LLaVA never runs it and its checkpoints leave it out
            load_whole(self.vision_tower, parts["vision"], "LLaVA checkpoint: vision tower", ("head.",))
            load_whole(self.multi_modal_projector, parts["projector"], "LLaVA checkpoint: projector")

    @classmethod
    def example_configs(cls) -> dict[str, dict]:
        return {"LlavaForConditionalGeneration": example_config()}


def example_config(vocab_size: int = 300, image_token_id: int = 299) -> dict:
    """A tiny LLaVA config: CLIP tower on 56-pixel images in 14-pixel patches (16 image tokens
    after the CLS is dropped), a two-layer Llama text model."""
    return dict(
        model_type="llava",
        text_config=dict(
            model_type="llama",
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            rms_norm_eps=1e-3,
            rope_theta=5000.0,
        ),
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=56,
            patch_size=14,
            projection_dim=32,
        ),
        image_token_id=image_token_id,
        projector_hidden_act="gelu",
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
