"""LLaVA's images as the model takes them, through the checkpoint's own ``transformers``
processor (its image processor resizes, crops and normalizes; the processor's expansion of one
``<image>`` says how many tokens an image takes)."""

from __future__ import annotations

from engine.interfaces import MultiModalProcessor, ProcessedImage


class LlavaImageProcessor(MultiModalProcessor):
    def __init__(self, model_path: str, hf_config):
        super().__init__(model_path, hf_config)
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_path)
        self.placeholder_token_id = hf_config.image_token_id

    def process_image(self, image) -> ProcessedImage:
        """The processor expands a lone ``<image>`` to the image's tokens: their count is what
        the prompt's placeholder becomes (the vision tower's patches, less CLS by the config's
        feature strategy), whatever the checkpoint's image size."""
        out = self.processor(
            text=self.processor.image_token, images=[image.convert("RGB")], return_tensors="pt"
        )
        num_tokens = int((out["input_ids"] == self.placeholder_token_id).sum())
        return ProcessedImage({"pixel_values": out["pixel_values"]}, num_tokens)
