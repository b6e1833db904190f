"""Images in chat messages, for every front end (``LLM.chat`` and the server's chat route):
OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}`` and vLLM's offline
``{"type": "image_pil", "image_pil": <PIL image>}`` parts. Each is taken out of its message in
order and replaced by ``{"type": "image"}``, the part a multimodal chat template renders as the
model's image placeholder.

Where an ``image_url`` may point is the :class:`MediaPolicy`'s to say: a base64 ``data:`` URL
always; a ``file:`` URL only inside ``allowed_local_media_path`` (vLLM's flag; the path's
symlinks resolved before the check, so none leads out); an ``http(s):`` URL only on a host of
``allowed_media_domains`` (vLLM's flag; off by default), fetched without redirects, within a
timeout (the whole fetch) and a byte cap. Every image is bounded by its pixel count, read from
its header before any pixel is decoded (PIL's ``MAX_IMAGE_PIXELS``), so a decompression bomb
costs nothing, and by its aspect ratio (a strip resized for the model would be huge). Each
refusal is an :class:`InvalidParam` naming what is wrong (a 400 on the server)."""

from __future__ import annotations

import base64
import binascii
import io
import os
import time
import urllib.error
import urllib.parse
import urllib.request

import attrs

from engine.messages.sampling_params import InvalidParam

IMAGE_PART = {"type": "image"}  # what a template sees where an image was
IMAGE_PART_TYPES = ("image_url", "image_pil")
FETCH_CHUNK = 64 * 1024  # bytes read at a time from a fetched image
# a processor resizes the shorter side up to its size: a 1-pixel-high strip within the pixel
# limit would become a huge tensor (Qwen2-VL's processor refuses the same ratio)
MAX_ASPECT_RATIO = 200


@attrs.frozen
class MediaPolicy:
    """Where image URLs may point, and how much a fetch may take. The default reads only
    base64 ``data:`` URLs."""

    allowed_local_media_path: str | None = None  # a directory file: URLs may read under
    allowed_media_domains: tuple[str, ...] = ()  # hosts http(s) URLs may fetch from; none: no fetching
    fetch_timeout: float = 5.0  # seconds a fetch may take, connecting and reading
    max_bytes: int = 20 * 2**20  # the most bytes an image file may have, read or fetched
    max_pixels: int | None = None  # None: PIL's MAX_IMAGE_PIXELS

    def __attrs_post_init__(self):
        root = self.allowed_local_media_path
        if root is not None and not os.path.isdir(root):
            raise ValueError(f"allowed_local_media_path: {root!r} is not a directory")


def split_images(messages: list, policy: MediaPolicy | None = None) -> tuple[list, list]:
    """(the messages with each image part replaced by :data:`IMAGE_PART`, the images in order)."""
    policy = policy or MediaPolicy()
    images: list = []
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            image = _image_of(part, policy)
            if image is None:
                parts.append(part)
            else:
                images.append(image)
                parts.append(IMAGE_PART)
        out.append({**message, "content": parts})
    return out, images


def count_images(messages: list) -> int:
    """How many image parts the messages hold (counted before any is read)."""
    return sum(
        1
        for message in messages
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES
    )


def _image_of(part, policy: MediaPolicy):
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "image_pil":
        from PIL import Image

        image = part.get("image_pil")
        if not isinstance(image, Image.Image):  # what JSON sends: image_pil is LLM.chat's
            raise InvalidParam("messages", "image_pil: give a PIL image (over HTTP: an image_url part)")
        return image
    if kind == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise InvalidParam("messages", "image_url: give {'url': 'data:image/...;base64,...'}")
        return load_image_url(url, policy)
    return None


def load_image_url(url: str, policy: MediaPolicy | None = None):
    """An image URL the policy allows (None: base64 data: URLs only) -> a decoded PIL image;
    InvalidParam naming what is wrong."""
    policy = policy or MediaPolicy()
    scheme = url.partition(":")[0].lower() if ":" in url else ""
    if scheme == "data":
        raw = _data_url_bytes(url)
    elif scheme == "file":
        raw = _local_file_bytes(url, policy)
    elif scheme in ("http", "https"):
        raw = _fetched_bytes(url, policy)
    else:
        raise InvalidParam(
            "messages",
            f"image_url: a {scheme[:16]!r} URL is not accepted; give a base64 data: URL "
            "(file: and http(s): URLs only where the server allows them)",
        )
    if len(raw) > policy.max_bytes:
        raise InvalidParam("messages", f"image_url: the image is larger than {policy.max_bytes} bytes")
    return decode_image(raw, policy.max_pixels)


def _data_url_bytes(url: str) -> bytes:
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma or not header.endswith(";base64"):
        raise InvalidParam("messages", "image_url: a data URL must be base64: data:image/png;base64,...")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidParam("messages", "image_url: the data URL's payload is not valid base64") from None


def _local_file_bytes(url: str, policy: MediaPolicy) -> bytes:
    """A ``file:`` URL's bytes, only from inside ``allowed_local_media_path``: the path is
    resolved (symlinks and ``..``) before the check, and the resolved path is what is read."""
    root = policy.allowed_local_media_path
    if root is None:
        raise InvalidParam(
            "messages",
            "image_url: file: URLs are off; the server reads local files only under "
            "--allowed-local-media-path (allowed_local_media_path)",
        )
    parsed = urllib.parse.urlsplit(url)
    if parsed.netloc not in ("", "localhost"):
        raise InvalidParam("messages", f"image_url: a file: URL names no host, got {parsed.netloc[:64]!r}")
    path = os.path.realpath(urllib.parse.unquote(parsed.path))
    root = os.path.realpath(root)
    if os.path.commonpath([path, root]) != root:
        raise InvalidParam("messages", "image_url: the file: URL leads outside allowed_local_media_path")
    if not os.path.isfile(path):
        raise InvalidParam(
            "messages", "image_url: the file: URL names no file under allowed_local_media_path"
        )
    with open(path, "rb") as f:
        return f.read(policy.max_bytes + 1)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect could lead off the allowed hosts: it is an error, not followed."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise InvalidParam("messages", f"image_url: the server of the URL answered with a redirect ({code})")


def _fetched_bytes(url: str, policy: MediaPolicy) -> bytes:
    """An ``http(s):`` URL's body, only from a host of ``allowed_media_domains``, at most
    ``max_bytes`` (one more is read to tell), within ``fetch_timeout`` per socket operation."""
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host not in {domain.lower() for domain in policy.allowed_media_domains}:
        raise InvalidParam(
            "messages",
            f"image_url: fetching from {host[:64]!r} is not allowed; the server fetches only from "
            "the hosts of --allowed-media-domains (allowed_media_domains)",
        )
    opener = urllib.request.build_opener(_NoRedirects)
    deadline = time.monotonic() + policy.fetch_timeout
    try:
        with opener.open(url, timeout=policy.fetch_timeout) as response:
            return _read_until(response, policy.max_bytes + 1, deadline)
    except InvalidParam:  # a redirect refused, the deadline passed
        raise
    except urllib.error.HTTPError as exc:
        raise InvalidParam("messages", f"image_url: fetching the URL failed with HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise InvalidParam("messages", f"image_url: fetching the URL failed ({reason})") from None


def _read_until(response, limit: int, deadline: float) -> bytes:
    """At most ``limit`` bytes of the body, refused once ``deadline`` passed (a server that
    trickles bytes cannot hold a fetch past it by more than one socket timeout)."""
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        if time.monotonic() > deadline:
            raise InvalidParam("messages", "image_url: fetching the URL timed out")
        chunk = response.read1(min(FETCH_CHUNK, limit - size))  # what arrived: read() waits for all
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def decode_image(raw: bytes, max_pixels: int | None = None):
    """Image file bytes -> a decoded PIL image, refused before decoding when its header says
    it has more than ``max_pixels`` (default: PIL's ``MAX_IMAGE_PIXELS``)."""
    from PIL import Image, UnidentifiedImageError

    limit = max_pixels if max_pixels is not None else Image.MAX_IMAGE_PIXELS
    try:
        image = Image.open(io.BytesIO(raw))
    except Image.DecompressionBombError:
        raise InvalidParam(
            "messages",
            f"image_url: the image's header claims more than twice {limit} pixels (a decompression bomb)",
        ) from None
    except (UnidentifiedImageError, OSError):
        raise InvalidParam("messages", "image_url: the data is not an image PIL can read") from None
    width, height = image.size
    if limit is not None and width * height > limit:
        raise InvalidParam(
            "messages",
            f"image_url: a {width}x{height} image ({width * height} pixels) exceeds the limit of {limit}",
        )
    if max(width, height) > MAX_ASPECT_RATIO * max(1, min(width, height)):
        raise InvalidParam(
            "messages",
            f"image_url: a {width}x{height} image is more than {MAX_ASPECT_RATIO} times as long as "
            "it is wide",
        )
    try:
        image.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidParam("messages", f"image_url: the image data is broken ({exc})") from None
    return image
