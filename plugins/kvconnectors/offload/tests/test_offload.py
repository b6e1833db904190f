"""Acceptance: a tiny random Llama (float32) with a KV pool small enough that other prompts
evict a shared prefix; the prefix then comes back from the offload tiers instead of being
recomputed, and greedy outputs are those of the same requests without the connector."""

from __future__ import annotations

import os

import pytest

from engine import LLM, SamplingParams
from engine.testing import reference

VOCAB = 256
BLOCK = 8
OPTIONS = dict(dtype="float32", block_size=BLOCK, num_blocks=26, max_model_len=192, max_num_seqs=2)


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
def workload():
    """A prompt with a 64-token prefix, three long prompts that take the pool, then the prefix again."""
    shared, *others = reference.random_prompts(VOCAB, [64, 120, 120, 120, 5, 7], seed=3)
    first, fillers, second = shared + others[3], others[:3], shared + others[4]
    return first, fillers, second


def _run(llm, workload):
    first, fillers, second = workload
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = [llm.generate([first], params)[0]]
    outs += [llm.generate([p], params)[0] for p in fillers]
    outs.append(llm.generate([second], params)[0])
    return [o.outputs[0].token_ids for o in outs], outs[-1]


@pytest.fixture(scope="module")
def expected(tiny_model, workload):
    llm = LLM(tiny_model, **OPTIONS)
    tokens, last = _run(llm, workload)
    assert last.num_cached_tokens == 0, "the fillers were meant to evict the shared prefix"
    return tokens


def _offload(folder, **extra):
    return LLM(
        folder, kv_transfer_config={"kv_connector": "offload", "kv_connector_extra_config": extra}, **OPTIONS
    )


def test_evicted_prefix_reloads_from_the_cpu_tier(tiny_model, workload, expected):
    llm = _offload(tiny_model)
    tokens, last = _run(llm, workload)
    assert tokens == expected
    stats = llm.engine.stats()
    assert stats["external_prefix_hits"] == 64 and last.num_cached_tokens == 64
    block_bytes = llm.engine.runner.connector.ctx.block_bytes
    assert stats["kv_load_bytes"] == 8 * block_bytes and stats["kv_load_seconds"] > 0
    assert stats["kv_save_bytes"] >= 8 * block_bytes


def test_bfloat16_reload_gives_the_recomputed_tokens(tiny_model, workload):
    """In bfloat16 a matmul's rounding depends on the rows beside it, so the prefix's K/V computed
    inside another prompt differ in the last bits from a recompute; batch-invariant mode (each
    row's result independent of its batch) makes the reloaded K/V those a recompute writes."""
    options = {**OPTIONS, "dtype": "bfloat16", "batch_invariant": True}
    plain, _ = _run(LLM(tiny_model, **options), workload)
    offload = LLM(tiny_model, kv_transfer_config={"kv_connector": "offload"}, **options)
    tokens, last = _run(offload, workload)
    assert last.num_cached_tokens == 64 and tokens == plain


def test_disk_tier_serves_blocks_the_cpu_tier_pushed_down(tiny_model, workload, expected, tmp_path):
    probe = _offload(tiny_model)
    block_bytes = probe.engine.runner.connector.ctx.block_bytes
    llm = _offload(tiny_model, cpu_bytes=2 * block_bytes, disk_path=str(tmp_path), disk_bytes=1 << 30)
    tokens, last = _run(llm, workload)
    assert tokens == expected and last.num_cached_tokens == 64
    assert any(name.endswith(".kv") for name in os.listdir(tmp_path))


def test_a_damaged_block_file_is_recomputed(tiny_model, workload, expected, tmp_path):
    probe = _offload(tiny_model)
    block_bytes = probe.engine.runner.connector.ctx.block_bytes
    llm = _offload(tiny_model, cpu_bytes=2 * block_bytes, disk_path=str(tmp_path), disk_bytes=1 << 30)
    first, fillers, second = workload
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = [llm.generate([p], params)[0].outputs[0].token_ids for p in [first, *fillers]]
    for name in sorted(os.listdir(tmp_path))[:3]:
        with open(tmp_path / name, "wb") as f:
            f.write(b"damaged")
    outs.append(llm.generate([second], params)[0].outputs[0].token_ids)
    assert outs == expected
    assert llm.engine.stats()["kv_load_failures"] == 1


def test_bad_extra_config_names_the_key(tiny_model):
    with pytest.raises(ValueError, match="kv_connector_extra_config.cpu_bytes"):
        _offload(tiny_model, cpu_bytes=-1)
    with pytest.raises(ValueError, match="unknown key"):
        _offload(tiny_model, cpu_size=1)
    with pytest.raises(ValueError, match="disk_bytes: needs disk_path"):
        _offload(tiny_model, disk_bytes=100)
