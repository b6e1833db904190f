"""Qwen2-VL and Qwen2.5-VL (``Qwen2VLForConditionalGeneration``,
``Qwen2_5_VLForConditionalGeneration``): a vision tower over 14-pixel patches (a temporal patch
of 2, 2-D rotary, Qwen2.5-VL's window attention with a few full-attention layers, a merger of
2x2 patches into the text model's hidden size) and a Qwen2 text model whose rotary embedding
is M-RoPE: each token has a temporal, a height and a width position, and sections of the
rotary frequencies turn by each (``mrope_section``).

The vision tower is ``transformers``' own module, run once per image by the engine's encoder
cache (as models-llava runs CLIP). The text model runs on the core's decoder layers over the
flattened token axis; it declares three position axes (``position_axes``, models v5), and
:meth:`QwenVLForConditionalGeneration.prompt_positions` gives a prompt's positions as
``transformers``' ``get_rope_index`` does: text tokens count up on all three axes, an image's
tokens sit on its merged grid (t, row, column) from the position after the text before it, and
the text after an image resumes past its largest extent. Parameter names are Hugging Face's in
both the ``transformers`` 5 (``model.language_model.*``, ``model.visual.*``) and the original
(``model.*``, ``visual.*``) layouts."""

from __future__ import annotations

import copy
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
    RotaryEmbedding,
    load_whole,
    route_by_prefix,
)
from engine_models_qwen_vl.processor import QwenVLImageProcessor

AXES = 3  # temporal, height, width

# checkpoint name prefix -> (part, prefix it has inside that part); the first that matches wins
_PREFIXES = (
    ("model.language_model.", "text", "model."),
    ("model.visual.", "vision", ""),
    ("visual.", "vision", ""),
    ("lm_head.", "text", "lm_head."),
    ("model.", "text", "model."),
)


def mrope_section(text_config) -> list[int]:
    params = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    return list(params.get("mrope_section") or ())


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE: the rotary tables looked up once per axis, and frequency ``j`` of each half of a
    head taken from the axis whose ``mrope_section`` holds it (``transformers``'
    ``apply_multimodal_rotary_pos_emb``). One-axis positions [T] are every axis alike (text)."""

    def __init__(self, cfg, max_positions: int, dtype, ops, sections: list[int]):
        super().__init__(cfg, max_positions, dtype, ops)
        axis = torch.repeat_interleave(torch.arange(len(sections)), torch.tensor(sections))
        self.register_buffer("axis_of_dim", torch.cat([axis, axis]), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions)
        index = self.axis_of_dim.view(1, 1, -1).expand(1, positions.shape[1], -1)

        def table(values):  # [axes, T, D] -> [T, 1, D], each dim from its axis
            return values[positions].gather(0, index)[0].unsqueeze(1)

        return table(self.cos), table(self.sin)


class QwenVLTextModel(DecoderForCausalLM):
    """The Qwen2 text model (q/k/v biases, GQA, SwiGLU) on the core's decoder layers, its
    rotary embedding M-RoPE."""

    architectures = ()

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg = ctx.hf_config
        self.model.rotary = MRotaryEmbedding(
            cfg, cfg.max_position_embeddings, ctx.dtype, self.model.rotary.ops, mrope_section(cfg)
        )

    def decoder_layer(self, cfg, index, method, dtype, ops):
        attention = DecoderAttention(cfg, index, method, dtype, ops, qkv_bias=True)
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, False, method, dtype, ops)
        return DecoderLayer(attention, mlp, cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)


def vision_tower(cfg, dtype) -> nn.Module:
    """``transformers``' vision tower of the checkpoint's family."""
    if cfg.model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as Tower,
        )
    else:
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (  # type: ignore[assignment]
            Qwen2VisionTransformerPretrainedModel as Tower,
        )
    return Tower._from_config(cfg.vision_config).to(dtype).eval()


class QwenVLForConditionalGeneration(Model):
    architectures = ("Qwen2_5_VLForConditionalGeneration", "Qwen2VLForConditionalGeneration")
    multimodal_processor = QwenVLImageProcessor
    position_axes = AXES

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg = self.cfg = ctx.hf_config
        text = copy.deepcopy(cfg.text_config)
        text.tie_word_embeddings = getattr(cfg, "tie_word_embeddings", False)  # set at the top level
        self.language_model = QwenVLTextModel(attrs.evolve(ctx, hf_config=text))
        # text only (limit_mm_per_prompt {"image": 0}): no vision tower built, its weights skipped
        self.visual = vision_tower(cfg, ctx.dtype) if ctx.takes("image") else None

    @classmethod
    def supports(cls, hf_config) -> list[str]:
        reasons = []
        text = hf_config.text_config
        if hf_config.model_type not in ("qwen2_5_vl", "qwen2_vl"):
            reasons.append(f"model type {hf_config.model_type!r} (qwen2_vl or qwen2_5_vl only)")
        params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
        if params.get("rope_type", "default") != "default":  # transformers reads "mrope" as default
            reasons.append(f"rope type {params.get('rope_type')!r} (plain M-RoPE only)")
        head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        sections = mrope_section(text)
        if len(sections) != AXES or 2 * sum(sections) != head:
            reasons.append(f"mrope_section {sections} must be 3 sections covering half of head_dim {head}")
        if getattr(text, "use_sliding_window", False):
            reasons.append("a sliding-window text model is not supported")
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
        """One image's patches [patches, C·2·14·14] and grid [1, 3] -> its merged features
        [tokens, hidden], as ``transformers``' ``get_image_features``."""
        if self.visual is None:
            raise ValueError("images are off (limit_mm_per_prompt): no vision tower was loaded")
        pixels = data["pixel_values"].to(self.ctx.dtype)
        return self.visual(pixels, grid_thw=data["image_grid_thw"]).pooler_output

    def prompt_positions(self, prompt_token_ids: list[int], mm_items: tuple) -> tuple[torch.Tensor, int]:
        return mrope_positions(len(prompt_token_ids), mm_items, self.cfg.vision_config.spatial_merge_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        vision: dict[str, torch.Tensor] = {}

        def text_weights():
            for name, tensor in weights:
                part, inner = route_by_prefix(name, _PREFIXES, "Qwen-VL")
                if part == "text":
                    yield inner, tensor
                else:
                    vision[inner] = tensor

        self.language_model.load_weights(text_weights())
        if self.visual is not None:
            load_whole(self.visual, vision, "Qwen-VL checkpoint: vision tower")

    @classmethod
    def example_configs(cls) -> dict[str, dict]:
        return {architecture: example_config(architecture) for architecture in cls.architectures}


def mrope_positions(num_tokens: int, mm_items, merge: int) -> tuple[torch.Tensor, int]:
    """``transformers``' ``get_rope_index`` for one prompt of ``num_tokens`` tokens whose images
    are ``mm_items``: text counts up on every axis; an image's tokens take (start + t, start +
    row, start + column) over its grid of merged patches (``merge`` x ``merge`` patches a token),
    and the text after it resumes at start + the grid's larger side. -> (positions [3,
    num_tokens], the offset later tokens add to their index: ``max + 1 - num_tokens``)."""
    pieces, start, previous = [], 0, 0
    for item in sorted(mm_items, key=lambda i: i.offset):
        pieces.append(_text_positions(start, item.offset - previous))
        start += item.offset - previous
        t, h, w = (int(n) for n in item.data["image_grid_thw"].reshape(-1))
        grid = torch.meshgrid(
            torch.arange(t), torch.arange(h // merge), torch.arange(w // merge), indexing="ij"
        )
        pieces.append(torch.stack(grid).reshape(AXES, -1) + start)
        start += max(h, w) // merge
        previous = item.end
    pieces.append(_text_positions(start, num_tokens - previous))
    positions = torch.cat(pieces, dim=1)
    return positions, int(positions.max()) + 1 - num_tokens


def _text_positions(start: int, length: int) -> torch.Tensor:
    return (torch.arange(length) + start).expand(AXES, -1)


def example_config(
    architecture: str = "Qwen2_5_VLForConditionalGeneration",
    vocab_size: int = 300,
    ids=None,
    tied: bool = False,
) -> dict:
    """A tiny config: a 4-layer vision tower (hidden 32; Qwen2.5-VL's windows of 2x2 merged
    patches, layers 1 and 3 attending the whole image) and a two-layer Qwen2 text model with
    M-RoPE sections [2, 3, 3] over its 16-wide heads, its weights large enough for attention
    to depend on positions."""
    ids = ids or {}
    qwen2_5 = architecture.startswith("Qwen2_5")
    text = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-3,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "mrope_section": [2, 3, 3]},
        # large enough weights that attention is peaked: a position off by one must show
        initializer_range=0.2,
    )
    if qwen2_5:
        vision = dict(
            depth=4,
            hidden_size=32,
            intermediate_size=64,
            num_heads=4,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1, 3],
        )
    else:
        vision = dict(
            depth=2,
            embed_dim=32,
            mlp_ratio=2,
            num_heads=4,
            hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        )
    return dict(
        model_type="qwen2_5_vl" if qwen2_5 else "qwen2_vl",
        text_config=text,
        vision_config=vision,
        image_token_id=ids.get("<|image_pad|>", vocab_size - 3),
        video_token_id=ids.get("<|video_pad|>", vocab_size - 1),
        vision_start_token_id=ids.get("<|vision_start|>", vocab_size - 4),
        vision_end_token_id=ids.get("<|vision_end|>", vocab_size - 2),
        tie_word_embeddings=tied,
    )
