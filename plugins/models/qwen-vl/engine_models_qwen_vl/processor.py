"""Qwen2-VL / Qwen2.5-VL images as the model takes them, through the checkpoint's own
``transformers`` image processor (``Qwen2VLImageProcessor``: its PIL variant where torchvision
is missing). It resizes each image to multiples of 28 pixels within the checkpoint's
``min_pixels`` / ``max_pixels`` (any aspect ratio: variable resolution), cuts it into 14-pixel
patches, repeated twice over the temporal patch, and reports the patch grid; the model merges
2x2 patches into one token, so an image takes ``t·h·w / merge²`` placeholder tokens.
``--mm-processor-kwargs '{"min_pixels": ..., "max_pixels": ...}'`` overrides the checkpoint's
bounds, as on vLLM."""

from __future__ import annotations

from engine.interfaces import MultiModalProcessor, ProcessedImage

PROCESSOR_OPTIONS = ("min_pixels", "max_pixels")


class QwenVLImageProcessor(MultiModalProcessor):
    def __init__(self, model_path: str, hf_config, processor_kwargs: dict | None = None):
        super().__init__(model_path, hf_config, processor_kwargs)
        from transformers import AutoImageProcessor

        options = check_options(self.processor_kwargs)
        self.image_processor = AutoImageProcessor.from_pretrained(model_path, **options)
        self.merge_size = hf_config.vision_config.spatial_merge_size
        self.placeholder_token_id = hf_config.image_token_id

    def process_image(self, image) -> ProcessedImage:
        out = self.image_processor(images=[image.convert("RGB")], return_tensors="pt")
        grid = out["image_grid_thw"]  # [1, 3]: temporal, height, width in patches
        data = {"pixel_values": out["pixel_values"], "image_grid_thw": grid}
        return ProcessedImage(data, int(grid.prod()) // self.merge_size**2)


def check_options(options: dict) -> dict:
    """``min_pixels`` / ``max_pixels``, positive integers, min not above max; any other key is
    refused by name (``transformers`` would ignore it silently)."""
    unknown = sorted(set(options) - set(PROCESSOR_OPTIONS))
    if unknown:
        raise ValueError(
            f"mm_processor_kwargs: {unknown[0]!r} is not an option of Qwen-VL's image processor "
            f"(it takes {', '.join(PROCESSOR_OPTIONS)})"
        )
    for key, value in options.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"mm_processor_kwargs: {key} must be a positive integer (pixels), got {value!r}")
    if options.get("min_pixels", 0) > options.get("max_pixels", options.get("min_pixels", 0)):
        raise ValueError("mm_processor_kwargs: min_pixels must not exceed max_pixels")
    return options
