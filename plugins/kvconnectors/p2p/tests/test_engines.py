"""Two real engines in one process (a tiny random Llama), joined by the p2p connector over TCP: a
batch of prompts of mixed lengths prefilled on one (``max_tokens=1``, ``do_remote_decode``) and
decoded on the other with the params the first handed on gives the greedy tokens of one engine
without a connector — in float32, and in bfloat16 under batch-invariant mode (without it a bf16
matmul's rounding depends on the rows beside it, so K/V computed inside another batch differ in
the last bits: the engine's own batch tolerance)."""

from __future__ import annotations

import time

import pytest

from engine import LLM, SamplingParams
from engine.interfaces import Request
from engine.testing import reference
from engine.testing.ports import free_port

VOCAB = 256
BLOCK = 8
LENGTHS = [3, 8, 9, 17, 30, 41, 64, 77]
MAX_TOKENS = [5, 7, 4, 9, 6, 8, 5, 7]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny"))
    reference.tiny_checkpoint(
        folder,
        "LlamaForCausalLM",
        dict(
            model_type="llama",
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        ),
    )
    return folder


@pytest.fixture(scope="module")
def prompts():
    return reference.random_prompts(VOCAB, LENGTHS, seed=5)


def engines(folder: str, **options):
    common = dict(block_size=BLOCK, num_blocks=96, max_model_len=192, **options)
    producer = LLM(
        folder,
        kv_transfer_config={"kv_connector": "p2p", "kv_role": "kv_producer", "kv_port": free_port()},
        **common,
    )
    consumer = LLM(folder, kv_transfer_config={"kv_connector": "p2p", "kv_role": "kv_consumer"}, **common)
    return LLM(folder, **common), producer, consumer


def disaggregated(producer: LLM, consumer: LLM, prompts, max_tokens) -> list[list[int]]:
    """Every prompt prefilled on ``producer`` at once, each decoded on ``consumer`` as soon as its
    prefill hands its params on; both engines step until every block is free again."""
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        producer.engine.add_request(
            Request(
                f"r{i}",
                prompt,
                SamplingParams(max_tokens=1, temperature=0),
                kv_transfer_params={"do_remote_decode": True},
            )
        )
    deadline = time.monotonic() + 120
    while len(tokens) < len(prompts) or any(
        e.has_unfinished() or e.has_pending_transfers() for e in (producer.engine, consumer.engine)
    ):
        assert time.monotonic() < deadline, "P/D did not finish"
        for out in producer.engine.step():
            if out.finished:
                index = int(out.request_id[1:])
                assert out.kv_transfer_params is not None, out
                consumer.engine.add_request(
                    Request(
                        out.request_id,
                        prompts[index],
                        SamplingParams(max_tokens=max_tokens[index], temperature=0, ignore_eos=True),
                        kv_transfer_params=out.kv_transfer_params,
                    )
                )
                tokens[out.request_id] = []
        for out in consumer.engine.step():
            tokens[out.request_id] += out.new_token_ids
        time.sleep(0.001)
    return [tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize(
    "options",
    [{"dtype": "float32"}, {"dtype": "bfloat16", "batch_invariant": True}],
    ids=["float32", "bf16-batch-invariant"],
)
def test_pd_gives_the_tokens_of_one_engine(tiny_model, prompts, options):
    alone, producer, consumer = engines(tiny_model, **options)
    try:
        params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in MAX_TOKENS]
        want = [o.outputs[0].token_ids for o in alone.generate(prompts, params)]
        assert disaggregated(producer, consumer, prompts, MAX_TOKENS) == want
        stats = consumer.engine.stats()
        assert stats["external_prefix_hits"] == sum((n - 1) // BLOCK * BLOCK for n in LENGTHS)
        assert stats["kv_load_failures"] == 0 and stats["kv_load_bytes"] > 0
        for llm in (producer, consumer):
            assert llm.engine.kv_cache_manager.usage == 0
    finally:
        producer.engine.shutdown()
        consumer.engine.shutdown()
