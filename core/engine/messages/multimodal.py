"""Multimodal inputs of a request: each image's placeholder span in the prompt, its content hash
and the tensors the model's encoder takes.

The front end asks the model's processor (:class:`engine.interfaces.MultiModalProcessor`) how
each image becomes tensors and how many placeholder tokens it takes; :func:`expand_placeholders`
(one implementation for every front end) then widens each placeholder token of the prompt to that
many and records the span. The core knows no model family: it only carries these items to the
runner, which runs the model's encoder once per image (:mod:`engine.runner.encoder_cache`) and
hands the model the embeddings of each step's image rows, and the prefix cache keys every block
an image overlaps by its ``mm_hash``."""

from __future__ import annotations

import hashlib
import inspect
from collections import Counter
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from engine.messages.sampling_params import InvalidParam

IMAGE = "image"


@attrs.frozen(eq=False)
class MultiModalItem:
    """One image of a request: its placeholder tokens are prompt positions
    ``[offset, offset + length)``; ``mm_hash`` identifies its content (the encoder cache and
    the prefix cache key by it); ``data`` holds the processed inputs the model's
    ``encode_multimodal`` takes (``pixel_values`` ...)."""

    modality: str
    offset: int
    length: int
    mm_hash: str
    data: dict[str, torch.Tensor]

    @property
    def end(self) -> int:
        return self.offset + self.length

    def to_dict(self) -> dict[str, Any]:
        """Plain types for the ZMQ protocol (msgpack): tensors as dtype, shape and raw bytes."""
        return {
            "modality": self.modality,
            "offset": self.offset,
            "length": self.length,
            "mm_hash": self.mm_hash,
            "data": {name: _tensor_to_wire(t) for name, t in self.data.items()},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MultiModalItem:
        data = {name: _tensor_from_wire(t) for name, t in d["data"].items()}
        return cls(d["modality"], d["offset"], d["length"], d["mm_hash"], data)


def _tensor_to_wire(tensor: torch.Tensor) -> dict[str, Any]:
    tensor = tensor.detach().cpu().contiguous()
    as_float = tensor.float() if tensor.dtype == torch.bfloat16 else tensor  # numpy has no bfloat16
    return {
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "data": as_float.numpy().tobytes(),
    }


def _tensor_from_wire(d: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, d["dtype"])
    wire_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    array = np.frombuffer(d["data"], dtype=torch.empty(0, dtype=wire_dtype).numpy().dtype)
    return torch.from_numpy(array.copy()).reshape(d["shape"]).to(dtype)


def image_hash(image) -> str:
    """A content hash of a PIL image: its mode, size and pixels (the same picture decoded from
    two files hashes equal; a different one never does)."""
    digest = hashlib.sha256(f"{image.mode}:{image.size}".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def images_of(multi_modal_data: dict | None) -> list:
    """vLLM's ``multi_modal_data``: ``{"image": image | [images]}`` -> the list of images."""
    if not multi_modal_data:
        return []
    unknown = sorted(set(multi_modal_data) - {IMAGE})
    if unknown:
        raise ValueError(f"multi_modal_data: unsupported modality {unknown[0]!r}; supported: 'image'")
    images = multi_modal_data[IMAGE]
    return list(images) if isinstance(images, (list, tuple)) else [images]


def expand_placeholders(
    prompt_token_ids: Sequence[int], images: Sequence, processor
) -> tuple[list[int], tuple[MultiModalItem, ...]]:
    """Widen the ``i``-th ``processor.placeholder_token_id`` of the prompt to the tokens image
    ``i`` takes, and describe each image's span. Placeholders and images must pair up."""
    placeholder = processor.placeholder_token_id
    where = [i for i, token in enumerate(prompt_token_ids) if token == placeholder]
    if len(where) != len(images):
        raise ValueError(
            f"multi_modal_data: {len(images)} image(s) but the prompt has {len(where)} image "
            f"placeholder(s) (token {placeholder}); put one per image"
        )
    ids: list[int] = []
    items = []
    previous = 0
    for position, image in zip(where, images):
        processed = processor.process_image(image)
        ids += prompt_token_ids[previous:position]
        items.append(MultiModalItem(IMAGE, len(ids), processed.num_tokens, image_hash(image), processed.data))
        ids += [placeholder] * processed.num_tokens
        previous = position + 1
    ids += prompt_token_ids[previous:]
    return ids, tuple(items)


def build_processor(processor_class, model_path: str, hf_config, processor_kwargs: dict | None):
    """The model's ``MultiModalProcessor``; ``processor_kwargs`` (vLLM's ``mm_processor_kwargs``)
    only to one whose constructor takes them, else a ValueError naming the option."""
    if not processor_kwargs:
        return processor_class(model_path, hf_config)
    if "processor_kwargs" not in inspect.signature(processor_class).parameters:
        raise ValueError(f"mm_processor_kwargs: {processor_class.__name__} takes no options")
    return processor_class(model_path, hf_config, processor_kwargs=processor_kwargs)


def no_images_reason(model_class, limits: dict | None) -> str | None:
    """Why an engine of ``model_class`` under ``limit_mm_per_prompt`` = ``limits`` takes no
    images (None: it takes them): the engine core and a front end in another process say the same."""
    if getattr(model_class, "multimodal_processor", None) is None:
        return "this model takes no images (text only)"
    if (limits or {}).get(IMAGE) == 0:
        return "images are off: limit_mm_per_prompt allows 0 per prompt (the vision encoder is not loaded)"
    return None


def block_extra_keys(items: Sequence[MultiModalItem], start: int, end: int) -> bytes:
    """The ``mm_hash`` of every image overlapping prompt positions ``[start, end)``: a prefix
    cache block's extra key, so the same tokens over another image never share K/V."""
    return b"".join(
        b"\0mm:" + item.mm_hash.encode() for item in items if item.offset < end and start < item.end
    )


def check_item_count(modality: str, count: int, limits: dict | None, param: str) -> None:
    """InvalidParam (``param``) when ``count`` items of ``modality`` exceed ``limits``
    (``limit_mm_per_prompt``); a front end checks before it decodes any."""
    limit = (limits or {}).get(modality)
    if limit is not None and count > limit:
        raise InvalidParam(
            param,
            f"{param}: {count} {modality}(s) exceed the limit of {limit} per prompt (limit_mm_per_prompt)",
        )


def check_mm_items(
    items: Sequence[MultiModalItem], num_prompt_tokens: int, no_images: str | None, limits: dict | None
) -> None:
    """Raise :class:`InvalidParam` (``multi_modal_data``) for images the engine cannot take:
    ``no_images`` (why it takes none: a text-only model ...), more than ``limits`` allows per
    modality, spans outside the prompt or overlapping each other."""
    if no_images is not None:
        raise InvalidParam("multi_modal_data", f"multi_modal_data: {no_images}")
    for modality, count in Counter(item.modality for item in items).items():
        check_item_count(modality, count, limits, "multi_modal_data")
    previous_end = 0
    for item in sorted(items, key=lambda i: i.offset):
        if item.offset < previous_end or item.end > num_prompt_tokens or item.length <= 0:
            raise InvalidParam(
                "multi_modal_data",
                f"multi_modal_data: {item.modality} span [{item.offset}, {item.end}) is not inside "
                f"the {num_prompt_tokens}-token prompt or overlaps another",
            )
        previous_end = item.end
