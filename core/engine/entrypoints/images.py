"""Images in chat messages, for every front end (``LLM.chat`` and, next, the server's chat
route): OpenAI's ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``
and vLLM's offline ``{"type": "image_pil", "image_pil": <PIL image>}`` parts. Each is taken out
of its message in order and replaced by ``{"type": "image"}``, the part a multimodal chat
template renders as the model's image placeholder. Only base64 ``data:`` URLs are read (no
file or network access); an image is bounded by its pixel count, read from its header before
any pixel is decoded (PIL's ``MAX_IMAGE_PIXELS``), so a decompression bomb costs nothing."""

from __future__ import annotations

import base64
import binascii
import io

from engine.messages.sampling_params import InvalidParam

IMAGE_PART = {"type": "image"}  # what a template sees where an image was


def split_images(messages: list) -> tuple[list, list]:
    """(the messages with each image part replaced by :data:`IMAGE_PART`, the images in order)."""
    images: list = []
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            image = _image_of(part)
            if image is None:
                parts.append(part)
            else:
                images.append(image)
                parts.append(IMAGE_PART)
        out.append({**message, "content": parts})
    return out, images


def _image_of(part):
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "image_pil":
        return part["image_pil"]
    if kind == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise InvalidParam("messages", "image_url: give {'url': 'data:image/...;base64,...'}")
        return load_image_url(url)
    return None


def load_image_url(url: str, max_pixels: int | None = None):
    """A base64 ``data:`` URL -> a decoded PIL image; InvalidParam naming what is wrong."""
    scheme, colon, _ = url.partition(":")
    if not colon or scheme.lower() != "data":
        raise InvalidParam(
            "messages", f"image_url: only base64 data: URLs are accepted, got a {scheme[:16]!r} URL"
        )
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma or not header.endswith(";base64"):
        raise InvalidParam("messages", "image_url: a data URL must be base64: data:image/png;base64,...")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidParam("messages", "image_url: the data URL's payload is not valid base64") from None
    return decode_image(raw, max_pixels)


def decode_image(raw: bytes, max_pixels: int | None = None):
    """Image file bytes -> a decoded PIL image, refused before decoding when its header says
    it has more than ``max_pixels`` (default: PIL's ``MAX_IMAGE_PIXELS``)."""
    from PIL import Image, UnidentifiedImageError

    limit = max_pixels if max_pixels is not None else Image.MAX_IMAGE_PIXELS
    try:
        image = Image.open(io.BytesIO(raw))
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError):
        raise InvalidParam("messages", "image_url: the data is not an image PIL can read") from None
    width, height = image.size
    if limit is not None and width * height > limit:
        raise InvalidParam(
            "messages",
            f"image_url: a {width}x{height} image ({width * height} pixels) exceeds the limit of {limit}",
        )
    try:
        image.load()
    except (OSError, SyntaxError, ValueError) as exc:
        raise InvalidParam("messages", f"image_url: the image data is broken ({exc})") from None
    return image
