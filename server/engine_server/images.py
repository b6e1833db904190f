"""Images in a chat request's messages, for a multimodal model: the same steps ``LLM.chat``
takes (:mod:`engine.entrypoints.images` reads each ``image_url`` part under the server's
:class:`MediaPolicy`, the model's processor widens each placeholder to the image's tokens:
:func:`engine.messages.multimodal.expand_placeholders`), each refusal a 400 on ``messages``.
Images are counted, and refused for a text-only model or over ``--limit-mm-per-prompt``,
before any is read. Runs on the prepare threads, off the event loop."""

from __future__ import annotations

import attrs

from engine.entrypoints.images import MediaPolicy, count_images, split_images
from engine.entrypoints.tokenizer import load_multimodal_processor
from engine.messages.multimodal import IMAGE, MultiModalItem, check_item_count, expand_placeholders
from engine.messages.sampling_params import InvalidParam
from engine_server.errors import bad_request


@attrs.frozen
class ImageInput:
    """What the server does with images: ``processor`` the model's ``MultiModalProcessor``
    (None: the engine takes no images, ``no_images`` says why), ``limits`` vLLM's
    ``limit_mm_per_prompt``, ``policy`` where image URLs may point."""

    processor: object | None = None
    no_images: str | None = "this model takes no images (text only)"
    limits: dict | None = None
    policy: MediaPolicy = attrs.Factory(MediaPolicy)


def load_image_input(args, options: dict, model_path: str) -> ImageInput:
    """The served model's image processor (as the engine core builds it) and the media flags."""
    processor, no_images = load_multimodal_processor(
        model_path,
        args.plugins,
        options.get("load_format"),
        options.get("model_impl", "auto"),
        options.get("limit_mm_per_prompt"),
        options.get("mm_processor_kwargs"),
    )
    policy = MediaPolicy(
        args.allowed_local_media_path,
        tuple(args.allowed_media_domains or ()),
        args.media_fetch_timeout,
        args.max_media_bytes,
    )
    return ImageInput(processor, no_images, options.get("limit_mm_per_prompt"), policy)


def take_images(images: ImageInput | None, messages: list[dict]) -> tuple[list[dict], list]:
    """(the messages with each image part a ``{"type": "image"}`` for the template, the decoded
    images in order); a 400 naming what is wrong. ``images`` None: a route that takes none."""
    count = count_images(messages)
    if not count:
        return messages, []
    if images is None or images.processor is None:
        reason = images.no_images if images is not None else "this route takes no images"
        raise bad_request(f"messages: {reason}", "messages")
    try:
        check_item_count(IMAGE, count, images.limits, "messages")
        return split_images(messages, images.policy)
    except InvalidParam as exc:
        raise bad_request(str(exc), "messages") from None


def image_url_part(url: str) -> dict:
    """The chat route's image part for ``url``: how the Anthropic and Responses routes hand
    their image blocks to the one reader (:func:`take_images`), fetching and limits included."""
    return {"type": "image_url", "image_url": {"url": url}}


def takes_images(images: ImageInput | None) -> bool:
    return images is not None and images.processor is not None


def with_images(
    images: ImageInput, ids: list[int], decoded: list
) -> tuple[list[int], tuple[MultiModalItem, ...]]:
    """The templated ids with each image placeholder widened to its image's tokens, and the
    images' items; a 400 when placeholders and images do not pair up (a placeholder the
    client wrote as text has no image)."""
    try:
        return expand_placeholders(ids, decoded, images.processor)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None
