"""Qwen2-VL / Qwen2.5-VL images as the model takes them, through the checkpoint's own
``transformers`` image processor (``Qwen2VLImageProcessor``: its PIL variant where torchvision
is missing). It resizes each image to multiples of 28 pixels within the checkpoint's
``min_pixels`` / ``max_pixels`` (any aspect ratio: variable resolution), cuts it into 14-pixel
patches, repeated twice over the temporal patch, and reports the patch grid; the model merges
2x2 patches into one token, so an image takes ``t·h·w / merge²`` placeholder tokens."""

from __future__ import annotations

from engine.interfaces import MultiModalProcessor, ProcessedImage


class QwenVLImageProcessor(MultiModalProcessor):
    def __init__(self, model_path: str, hf_config):
        super().__init__(model_path, hf_config)
        from transformers import AutoImageProcessor

        self.image_processor = AutoImageProcessor.from_pretrained(model_path)
        self.merge_size = hf_config.vision_config.spatial_merge_size
        self.placeholder_token_id = hf_config.image_token_id

    def process_image(self, image) -> ProcessedImage:
        out = self.image_processor(images=[image.convert("RGB")], return_tensors="pt")
        grid = out["image_grid_thw"]  # [1, 3]: temporal, height, width in patches
        data = {"pixel_values": out["pixel_values"], "image_grid_thw": grid}
        return ProcessedImage(data, int(grid.prod()) // self.merge_size**2)
