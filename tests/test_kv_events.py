"""KV events: the prefix cache reports the blocks it stores and evicts (vLLM's
``--kv-events-config``), in the core and over ZMQ from `engine serve`."""

from __future__ import annotations

import hashlib
import time
from array import array

import msgspec
import pytest
import zmq

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.messages.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventsConfig
from engine.testing import reference
from engine_server.guard import tenant_salt
from tests.conftest import TINY_LLAMA
from tests.serving import API_KEY, free_port, serve

BLOCK = 16
EVENTS = {"enable_kv_cache_events": True}
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def chain(tokens: list[int], salt: str = "") -> list[bytes]:
    """The engine's block hashes, written out: sha256(parent + int64 tokens), salt first."""
    hashes, parent = [], salt.encode()
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        parent = hashlib.sha256(parent + array("q", tokens[start : start + BLOCK]).tobytes()).digest()
        hashes.append(parent)
    return hashes


@pytest.fixture(scope="module")
def prompts():
    return reference.random_prompts(TINY_LLAMA["vocab_size"], [3 * BLOCK + 5, 2 * BLOCK + 1, 40], seed=3)


def test_stored_removed_and_cleared_follow_the_prefix_cache(tiny_llama, prompts):
    llm = LLM(
        tiny_llama[0],
        dtype="float32",
        num_blocks=8,
        block_size=BLOCK,
        max_num_seqs=1,
        max_model_len=96,
        kv_events_config=EVENTS,
    )
    engine = llm.engine
    llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY)
    stored = [e for e in engine.take_kv_events() if isinstance(e, BlockStored)]
    hashes = [h for e in stored for h in e.block_hashes]
    assert hashes == chain(prompts[0])  # the prompt's three full blocks (+4 tokens: no fourth)
    assert stored[0].parent_block_hash is None and stored[0].token_ids == tuple(
        prompts[0][: len(stored[0].token_ids)]
    )
    assert all(e.block_size == BLOCK for e in stored)
    assert engine.take_kv_events() == []  # taken once

    llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], GREEDY)  # 7 usable blocks: some evicted
    events = engine.take_kv_events()
    removed = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    now_stored = {h for e in events if isinstance(e, BlockStored) for h in e.block_hashes}
    assert removed and removed <= set(hashes) | now_stored  # only what had been stored leaves
    assert set(chain(prompts[1])) <= now_stored

    assert engine.kv_cache_manager.reset_prefix_cache()
    assert engine.take_kv_events() == [AllBlocksCleared()]


def test_without_the_config_nothing_is_recorded(tiny_llm, prompts):
    tiny_llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY)
    assert tiny_llm.engine.take_kv_events() == []


def test_the_config_takes_vllms_fields_and_names_unknown_ones():
    config = EngineConfig.from_kwargs(kv_events_config={**EVENTS, "endpoint": "tcp://*:6000", "topic": "kv"})
    assert config.kv_events_config.publishing and config.kv_events_config.endpoint == "tcp://*:6000"
    assert not KVEventsConfig(enable_kv_cache_events=True, publisher="null").publishing
    with pytest.raises(ValueError, match="unknown field.*endpont"):
        EngineConfig.from_kwargs(kv_events_config={"endpont": "tcp://*:1"})
    with pytest.raises(ValueError, match="publisher must be one of null, zmq"):
        EngineConfig.from_kwargs(kv_events_config={**EVENTS, "publisher": "kafka"})


# --- over ZMQ, as a vLLM subscriber reads them ---------------------------------------------


def _decode(payload: bytes) -> dict:
    """A batch read as plain msgpack, the arrays vLLM's wire format specifies:
    [ts, [[tag, fields...], ...], data_parallel_rank]."""
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert isinstance(ts, float)
    return {"rank": rank, "events": events}


def _receive(socket, until, timeout_ms: int = 20_000) -> list[tuple[int, dict]]:
    batches = []
    while not until(batches):
        assert socket.poll(timeout_ms), "no KV events arrived"
        topic, sequence, payload = socket.recv_multipart()
        assert topic == b"kv"
        batches.append((int.from_bytes(sequence, "big"), _decode(payload)))
    return batches


def _stored(batches) -> list[dict]:
    """The BlockStored events: ["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium]."""
    names = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
    return [dict(zip(names, e[1:])) for _, batch in batches for e in batch["events"] if e[0] == "BlockStored"]


@pytest.mark.slow
def test_engine_serve_publishes_vllms_wire_format_per_core_with_replay(tiny_llama, prompts):
    port, replay = free_port(2), free_port(2)  # each core publishes on port + its rank
    config = {**EVENTS, "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay}", "topic": "kv"}
    context = zmq.Context()
    try:
        with serve(
            tiny_llama[0],
            "--dtype",
            "float32",
            "--num-blocks",
            "64",
            "--served-model-name",
            "tiny",
            "-dp",
            "2",
            "--data-parallel-routing",
            "round-robin",
            "--kv-events-config",
            msgspec.json.encode(config).decode(),
        ) as server:
            subscribers = []
            for rank in (0, 1):  # each core publishes on the endpoint's port + its rank
                sub = context.socket(zmq.SUB)
                sub.setsockopt(zmq.SUBSCRIBE, b"kv")
                sub.connect(f"tcp://127.0.0.1:{port + rank}")
                subscribers.append(sub)
            time.sleep(1)  # a SUB socket's subscription reaches the publisher asynchronously
            client = server.openai()
            for prompt in prompts[:2]:  # round robin: prompt i to core i
                client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
            for rank, sub in enumerate(subscribers):
                batches = _receive(sub, lambda got: bool(_stored(got)))
                assert {batch["rank"] for _, batch in batches} == {rank}
                stored = _stored(batches)
                # the server salts each API key's requests apart, and the events carry that salt
                assert [h for e in stored for h in e["block_hashes"]] == [
                    int.from_bytes(h, "big") & (2**64 - 1) for h in chain(prompts[rank], tenant_salt(API_KEY))
                ]
                assert [t for e in stored for t in e["token_ids"]] == prompts[rank][
                    : len(chain(prompts[rank])) * BLOCK
                ]
                assert all(
                    e["medium"] == "CPU" and e["block_size"] == BLOCK and e["lora_id"] is None for e in stored
                )
                assert stored[0]["parent_block_hash"] is None
                if rank == 0:
                    seen = [sequence for sequence, _ in batches]

            dealer = context.socket(zmq.DEALER)  # core 0's replay, from the first batch on
            dealer.connect(f"tcp://127.0.0.1:{replay}")
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            replayed = []
            while True:
                assert dealer.poll(10_000), "the replay did not answer"
                _, sequence, payload = dealer.recv_multipart()
                if sequence == (-1).to_bytes(8, "big", signed=True):
                    break
                replayed.append(int.from_bytes(sequence, "big"))
                _decode(payload)
            assert replayed[: len(seen)] == seen == list(range(len(seen)))
    finally:
        context.destroy(linger=0)
