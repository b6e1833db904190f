"""The p2p transport's messages: a kind frame, a msgpack header, and for a served read one raw
frame per layer (the blocks as ``cache.index_select(block_dim, ids)`` lays them out).

    decode -> prefill   [b"read", {id, engine_id, request_id, block_ids, layout}]
                        [b"release", {engine_id, request_id}]
    prefill -> decode   [b"ok", {id}, layer 0 bytes, layer 1 bytes, ...]
                        [b"err", {id, error}]
"""

from __future__ import annotations

import warnings

import msgspec
import torch

READ, RELEASE, OK, ERR = b"read", b"release", b"ok", b"err"

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(dict)


def header(**fields) -> bytes:
    return _encoder.encode(fields)


def parse(frame) -> dict:
    """ValueError when the frame is not a header (a peer of another kind)."""
    try:
        return _decoder.decode(bytes(frame))
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a p2p header: {exc}") from exc


def block_frames(caches: list[torch.Tensor], block_dim: int, block_ids: list[int]) -> list[memoryview]:
    """One frame per layer: the blocks' bytes (a copy taken now: the caller may free the blocks
    once this returns)."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=caches[0].device)
    frames = []
    for cache in caches:
        blocks = cache.index_select(block_dim, index).cpu().contiguous()
        frames.append(memoryview(blocks.view(-1).view(torch.uint8).numpy()))
    return frames


def write_blocks(caches: list[torch.Tensor], block_dim: int, block_ids: tuple[int, ...], frames) -> None:
    """Copy one frame per layer into the caches' ``block_ids``; ValueError when a frame's size is
    not what that many blocks of the layer hold (nothing is written then)."""
    if len(frames) != len(caches):
        raise ValueError(f"{len(frames)} layer frames for {len(caches)} layers")
    tensors = []
    for cache, frame in zip(caches, frames):
        shape = list(cache.shape)
        shape[block_dim] = len(block_ids)
        with warnings.catch_warnings():  # a received frame is read-only; it is only read from
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(frame, dtype=torch.uint8)
        expected = cache.element_size()
        for size in shape:
            expected *= size
        if raw.numel() != expected:
            raise ValueError(f"a layer frame of {raw.numel()} bytes, {expected} expected")
        tensors.append(raw.view(cache.dtype).view(shape))
    index = torch.tensor(block_ids, dtype=torch.int64, device=caches[0].device)
    for cache, data in zip(caches, tensors):
        if cache.element_size() == 1:  # an fp8 cache: torch has no fp8 index_copy_ on the CPU
            cache, data = cache.view(torch.uint8), data.view(torch.uint8)
        cache.index_copy_(block_dim, index, data.to(cache.device))
