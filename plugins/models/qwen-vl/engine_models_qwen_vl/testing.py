"""For tests: a tiny random Qwen2.5-VL (or Qwen2-VL) checkpoint with its image processor
(``Qwen2VLImageProcessor``) and the kit's byte-level tokenizer with the vision tokens.

``transformers``' ``Qwen2_5_VLProcessor`` cannot be built without torchvision (its video
processor needs it), so the reference inputs come from :class:`ReferenceProcessor`, which does
what that processor does for images: each ``<|image_pad|>`` widened to the image's merged
patches, and ``mm_token_type_ids`` marking them for ``get_rope_index``."""

from __future__ import annotations

import torch

from engine.testing.tiny_tokenizer import tiny_tokenizer
from engine_models_qwen_vl.model import example_config

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
# renders an image part as Qwen's vision markers, as Qwen2-VL checkpoints' templates do
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }}{% else %}" + IMAGE_PLACEHOLDER + "{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
# an image of the kit's sizes (64x48 ...) is resized to at least 112x112 pixels: > 5 tokens
MIN_PIXELS, MAX_PIXELS = 112 * 112, 224 * 224


def save_tiny_qwen_vl(
    folder: str, seed: int = 0, architecture: str = "Qwen2_5_VLForConditionalGeneration", tied: bool = False
):
    """Save model, config and processor to ``folder``; return the ``transformers`` model and
    processor (the parity reference). ``tied``: the LM head is the token embeddings (set at
    the config's top level, as Qwen2-VL-2B and Qwen2.5-VL-3B do)."""
    import transformers
    from transformers import AutoTokenizer, Qwen2VLImageProcessor

    tiny_tokenizer().save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))))
    config_kwargs = example_config(architecture, len(tokenizer), ids, tied)
    config_kwargs.pop("model_type")
    qwen2_5 = architecture.startswith("Qwen2_5")
    config_cls = transformers.Qwen2_5_VLConfig if qwen2_5 else transformers.Qwen2VLConfig
    config = config_cls(**config_kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():  # random norms: a dropped or swapped norm must show
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    image_processor = Qwen2VLImageProcessor(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14, temporal_patch_size=2, merge_size=2
    )
    image_processor.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, ReferenceProcessor(image_processor, tokenizer, ids["<|image_pad|>"])


class ReferenceProcessor:
    """``Qwen2VLProcessor.__call__`` for text and images: what ``transformers``' ``generate``
    takes."""

    def __init__(self, image_processor, tokenizer, image_token_id: int):
        self.image_processor, self.tokenizer, self.image_token_id = image_processor, tokenizer, image_token_id

    def __call__(self, text: str, images=None, return_tensors: str = "pt") -> dict:
        ids = self.tokenizer(text)["input_ids"]
        out: dict = {}
        if images:
            out = dict(
                self.image_processor(images=[image.convert("RGB") for image in images], return_tensors="pt")
            )
            counts = iter((out["image_grid_thw"].prod(-1) // self.image_processor.merge_size**2).tolist())
            ids = [
                t
                for token in ids
                for t in ([token] * next(counts) if token == self.image_token_id else [token])
            ]
        input_ids = torch.tensor([ids])
        return {
            **out,
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "mm_token_type_ids": (input_ids == self.image_token_id).int(),
        }
