"""The core's multimodal path without a model: placeholder expansion, the encoder cache's
byte-bounded LRU, images as prefix-cache keys, the items' trip over the ZMQ protocol, the
checks that refuse bad images, and images in chat messages (data URLs read and bounded)."""

from __future__ import annotations

import base64
import io

import attrs
import pytest
import torch

from engine.client import protocol
from engine.entrypoints.chat_template import conversation
from engine.entrypoints.images import MediaPolicy, load_image_url, split_images
from engine.interfaces import ProcessedImage
from engine.messages.kv_events import block_hashes, chain_hashes
from engine.messages.multimodal import MultiModalItem, check_mm_items, expand_placeholders, images_of
from engine.messages.request import Request
from engine.messages.sampling_params import InvalidParam, SamplingParams
from engine.messages.step import ScheduledRequest
from engine.runner.encoder_cache import EncoderCache, step_embeddings

PLACEHOLDER = 9


@attrs.define
class FakeImage:
    """What image hashing reads of a PIL image."""

    pixels: bytes
    mode: str = "RGB"
    size: tuple[int, int] = (2, 2)

    def tobytes(self) -> bytes:
        return self.pixels


class TokensPerByte:
    """A processor whose image takes one token per pixel byte."""

    placeholder_token_id = PLACEHOLDER

    def process_image(self, image) -> ProcessedImage:
        return ProcessedImage({"pixel_values": torch.tensor(list(image.pixels))}, len(image.pixels))


def item(mm_hash: str, offset: int, length: int) -> MultiModalItem:
    return MultiModalItem("image", offset, length, mm_hash, {})


def test_placeholders_widen_to_each_images_tokens():
    ids, items = expand_placeholders(
        [1, PLACEHOLDER, 2, PLACEHOLDER], [FakeImage(b"abc"), FakeImage(b"de")], TokensPerByte()
    )
    assert ids == [1, 9, 9, 9, 2, 9, 9]
    assert [(i.offset, i.length) for i in items] == [(1, 3), (5, 2)]
    assert items[0].mm_hash != items[1].mm_hash
    assert items[0].data["pixel_values"].tolist() == list(b"abc")


def test_placeholders_and_images_must_pair():
    with pytest.raises(ValueError, match="1 image\\(s\\) but the prompt has 2 image placeholder"):
        expand_placeholders([PLACEHOLDER, PLACEHOLDER], [FakeImage(b"a")], TokensPerByte())


def test_multi_modal_data_takes_vllms_shapes():
    assert images_of({"image": "one"}) == ["one"]
    assert images_of({"image": ["a", "b"]}) == ["a", "b"]
    with pytest.raises(ValueError, match="unsupported modality 'audio'"):
        images_of({"audio": b""})


def test_checks_refuse_bad_items():
    with pytest.raises(ValueError, match="takes no images"):
        check_mm_items([item("a", 0, 2)], 4, "this model takes no images (text only)", None)
    with pytest.raises(ValueError, match="2 image\\(s\\) exceed the limit of 1"):
        check_mm_items([item("a", 0, 1), item("b", 1, 1)], 4, None, {"image": 1})
    with pytest.raises(ValueError, match="not inside the 4-token prompt"):
        check_mm_items([item("a", 3, 2)], 4, None, None)
    with pytest.raises(ValueError, match="overlaps another"):
        check_mm_items([item("a", 0, 2), item("b", 1, 2)], 4, None, None)
    check_mm_items([item("a", 0, 2), item("b", 2, 2)], 4, None, {"image": 2})


def test_encoder_cache_is_a_byte_bounded_lru():
    rows = torch.zeros(4, 2)  # 32 bytes
    cache = EncoderCache(capacity_bytes=64)

    def encode(mm):
        return rows.clone()

    for name in ("a", "b", "a", "c"):  # "c" evicts "b", the least recently used
        cache.embeddings(item(name, 0, 4), encode)
    assert cache.encoder_runs == 3 and cache.hits == 1 and cache.used_bytes == 64
    cache.embeddings(item("a", 0, 4), encode)
    assert cache.encoder_runs == 3
    cache.embeddings(item("b", 0, 4), encode)
    assert cache.encoder_runs == 4
    EncoderCache(16).embeddings(item("big", 0, 4), encode)  # larger than the cache: used, not kept


def test_encoder_rows_must_match_the_placeholders():
    with pytest.raises(ValueError, match="returned 3 rows for an image of 4 placeholder tokens"):
        EncoderCache(1024).embeddings(item("a", 0, 4), lambda mm: torch.zeros(3, 2))


def test_each_chunk_gets_its_slice_of_the_image():
    embeds = torch.arange(6.0).unsqueeze(1)  # image rows 0..5 at prompt positions 2..7
    request = Request("r", list(range(10)), SamplingParams(), mm_items=(item("a", 2, 6),))
    cache = EncoderCache(1024)
    request.num_computed_tokens = 4  # this chunk: positions 4..8, rows 0..4 of the batch
    rows, got = step_embeddings([ScheduledRequest(request, 5)], [3], cache, lambda mm: embeds, "cpu")
    assert rows.tolist() == [3, 4, 5, 6]  # positions 4..7 at batch rows 3..6
    assert got.flatten().tolist() == [2.0, 3.0, 4.0, 5.0]
    request.num_computed_tokens = 8  # past the image: nothing
    nothing = step_embeddings([ScheduledRequest(request, 2)], [0], cache, lambda mm: embeds, "cpu")
    assert nothing == (None, None)


def test_images_key_the_blocks_they_overlap():
    tokens = [1, 2, 3, 4, 9, 9, 9, 9, 5, 6, 7, 8]

    def hashes(*items):
        return block_hashes(Request("r", tokens, SamplingParams(), mm_items=items), 4)

    text = hashes()
    assert text == chain_hashes(tokens, 4)  # a text-only request hashes as before
    one, again, other = hashes(item("a", 4, 4)), hashes(item("a", 4, 4)), hashes(item("b", 4, 4))
    assert one == again
    assert one[0] == other[0] == text[0]  # the block before the image is shared
    assert one[1] != other[1] and one[1] != text[1]
    assert one[2] != other[2]  # the chain carries the image onward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_items_survive_the_protocol(dtype):
    data = {"pixel_values": torch.randn(1, 3, 4, 4).to(dtype)}
    sent = MultiModalItem("image", 3, 16, "abc", data)
    message = protocol.AddRequest("r", [1, 2], {}, mm_items=[sent.to_dict()])
    [received] = protocol.decode_to_core(protocol.encode(message)).mm_items
    got = MultiModalItem.from_dict(received)
    assert (got.modality, got.offset, got.length, got.mm_hash) == ("image", 3, 16, "abc")
    assert got.data["pixel_values"].dtype == dtype
    assert torch.equal(got.data["pixel_values"], data["pixel_values"])


def _png(width: int, height: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def _data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def test_data_urls_decode_to_images():
    image = load_image_url(_data_url(_png(4, 3)))
    assert image.size == (4, 3) and image.getpixel((0, 0)) == (10, 20, 30)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://example.com/cat.png", "fetching from 'example.com' is not allowed"),
        ("file:///etc/passwd", "file: URLs are off"),
        ("ftp://example.com/cat.png", "a 'ftp' URL is not accepted"),
        ("data:image/png,rawbytes", "must be base64"),
        ("data:image/png;base64,***", "not valid base64"),
        (_data_url(b"not an image at all"), "not an image PIL can read"),
        (_data_url(_png(64, 64)[:60]), "broken"),
    ],
)
def test_bad_image_urls_are_refused_by_name(url, message):
    with pytest.raises(InvalidParam, match=message):
        load_image_url(url)


def test_an_image_over_the_pixel_limit_is_refused_before_decoding():
    raw = _png(100, 100)
    assert load_image_url(_data_url(raw), MediaPolicy(max_pixels=10_000)).size == (100, 100)
    with pytest.raises(InvalidParam, match="a 100x100 image \\(10000 pixels\\) exceeds the limit of 9999"):
        load_image_url(_data_url(raw), MediaPolicy(max_pixels=9_999))


def test_image_parts_leave_their_messages_in_order():
    from PIL import Image

    url = _data_url(_png(2, 2))
    first = Image.new("RGB", (3, 1))
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "image_pil", "image_pil": first}, {"type": "text", "text": "hi"}],
        },
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]},
    ]
    out, images = split_images(messages)
    assert images[0] is first and images[1].size == (2, 2)
    with pytest.raises(InvalidParam, match="image_pil: give a PIL image"):
        split_images([{"role": "user", "content": [{"type": "image_pil", "image_pil": "first"}]}])
    assert out[1]["content"] == [{"type": "image"}, {"type": "text", "text": "hi"}]
    assert conversation(out, image_parts=True)[2]["content"] == [{"type": "image"}]
    text = [{"role": "user", "content": [{"type": "text", "text": "a"}]}]
    assert conversation(text, image_parts=True)[0]["content"] == "a"
    with pytest.raises(InvalidParam, match="unsupported content part 'video_url' \\(text, image_url"):
        conversation([{"role": "user", "content": [{"type": "video_url"}]}], image_parts=True)
    with pytest.raises(InvalidParam, match="unsupported content part 'image' \\(only text parts here\\)"):
        conversation(out)  # a front end that takes no images


def test_a_text_only_model_refuses_images(tiny_llm):
    """Offline and at the core (the path a server's request takes): named, and nothing queued."""
    image = FakeImage(b"abc")
    with pytest.raises(ValueError, match="multi_modal_data: this model takes no images \\(text only\\)"):
        tiny_llm.generate({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": image}})
    with pytest.raises(InvalidParam, match="this model takes no images"):
        tiny_llm.engine.add_request(Request("mm", [1, 2, 3], SamplingParams(), mm_items=(item("a", 1, 2),)))
    assert not tiny_llm.engine.has_unfinished()


def test_encoder_budget_cuts_a_chunk_before_an_image_that_does_not_fit():
    """An image is charged whole to the step that first reaches it; a chunk stops before the
    first one the step's budget no longer holds; a lone image longer than the whole budget
    gets a step of its own; a preempted request's images are charged again."""
    from engine.builtin.encoder_budget import EncoderBudget

    first, second = (
        MultiModalItem("image", offset, length, str(offset), {}) for offset, length in ((5, 16), (25, 10))
    )
    request = Request("r", list(range(40)), SamplingParams(), mm_items=(first, second))
    budget = EncoderBudget(20)
    charge = budget.fit(request, 0, 40)
    assert (charge.num_new, charge.tokens) == (25, 16)  # the second image waits
    budget.charge(request, charge)
    budget.begin()
    assert (budget.fit(request, 25, 15).num_new, budget.fit(request, 25, 15).tokens) == (15, 10)
    assert budget.fit(request, 10, 5).tokens == 0  # the first image's later rows: charged already
    budget.forget("r")  # preempted
    assert budget.fit(request, 10, 5).tokens == 16
    small = EncoderBudget(8)
    assert (small.fit(request, 0, 40).num_new, small.fit(request, 0, 40).tokens) == (25, 16)  # alone
    small.left = 7
    assert small.fit(request, 0, 40).num_new == 5  # not alone: waits for a step of its own
