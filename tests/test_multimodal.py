"""The core's multimodal path without a model: placeholder expansion, the encoder cache's
byte-bounded LRU, images as prefix-cache keys, the items' trip over the ZMQ protocol, and the
checks that refuse bad images."""

from __future__ import annotations

import attrs
import pytest
import torch

from engine.client import protocol
from engine.interfaces import ProcessedImage
from engine.messages.kv_events import block_hashes, chain_hashes
from engine.messages.multimodal import MultiModalItem, check_mm_items, expand_placeholders, images_of
from engine.messages.request import Request
from engine.messages.sampling_params import SamplingParams
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
        check_mm_items([item("a", 0, 2)], 4, False, None)
    with pytest.raises(ValueError, match="2 image\\(s\\) exceed the limit of 1"):
        check_mm_items([item("a", 0, 1), item("b", 1, 1)], 4, True, {"image": 1})
    with pytest.raises(ValueError, match="not inside the 4-token prompt"):
        check_mm_items([item("a", 3, 2)], 4, True, None)
    with pytest.raises(ValueError, match="overlaps another"):
        check_mm_items([item("a", 0, 2), item("b", 1, 2)], 4, True, None)
    check_mm_items([item("a", 0, 2), item("b", 2, 2)], 4, True, {"image": 2})


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
