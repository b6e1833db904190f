"""For tests: a tiny random LLaVA checkpoint with its processor (CLIP image processor + the
kit's byte-level tokenizer with the ``<image>`` token)."""

from __future__ import annotations

import torch

from engine.testing.tiny_tokenizer import tiny_tokenizer
from engine_models_llava.model import example_config

IMAGE_TOKEN = "<image>"
# renders an image part as the placeholder, as LLaVA checkpoints' templates do
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }}{% else %}<image>{% endif %}{% endfor %}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def save_tiny_llava(folder: str, seed: int = 0, text: dict | None = None, vision: dict | None = None):
    """Save model, config and processor to ``folder``; return the ``transformers`` model and
    processor (the parity reference). ``text`` / ``vision``: config fields over the tiny ones
    (a benchmark's larger shapes)."""
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tiny_tokenizer().save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    kwargs = {k: v for k, v in example_config(len(tokenizer), image_token_id).items() if k != "model_type"}
    kwargs["text_config"].update(text or {})
    kwargs["vision_config"].update(vision or {})
    config = LlavaConfig(**kwargs)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # random norms: a dropped or swapped norm must show
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    side, patch = config.vision_config.image_size, config.vision_config.patch_size
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side}
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token=IMAGE_TOKEN,
    )
    processor.save_pretrained(folder)
    return model, processor
