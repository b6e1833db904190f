"""Sleep mode and weight updates beside a KV connector (``docs/decisions.md``, issue 30): with the
``offload`` connector, sleeping at either level keeps its stored blocks valid (its pending saves
run before the pool is released; waking restores the same weights), so a prompt seen before comes
back from its tier with the same greedy tokens; a weight update makes it forget them, and the
prompt is computed afresh with the new checkpoint's ``transformers`` tokens. A P/D connector,
which implements no ``reset_cache``, is refused sleep mode in one line naming it."""

from __future__ import annotations

import threading

import pytest

from engine import LLM, SamplingParams
from engine.testing import reference
from engine.testing.ports import free_port
from tests.conftest import TINY_LLAMA

BLOCK = 16
PROMPT = reference.random_prompts(TINY_LLAMA["vocab_size"], [4 * BLOCK + 3], seed=7)[0]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
OPTIONS = dict(dtype="float32", block_size=BLOCK, kv_cache_memory=16 << 20, max_model_len=256)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folders = {name: str(tmp_path_factory.mktemp(name)) for name in ("a", "b")}
    models = {
        name: reference.tiny_checkpoint(folders[name], "LlamaForCausalLM", TINY_LLAMA, seed=seed)
        for seed, name in enumerate(folders)
    }
    return folders, models


@pytest.fixture(scope="module")
def llm(checkpoints):
    offload = {"kv_connector": "offload", "kv_connector_extra_config": {"cpu_bytes": 8 << 20}}
    return LLM(checkpoints[0]["a"], kv_transfer_config=offload, enable_sleep_mode=True, **OPTIONS)


def run(llm) -> tuple[list[int], int]:
    """The prompt's greedy tokens and the tokens its KV came with from the connector's tier."""
    before = llm.engine.stats()["external_prefix_hits"]
    tokens = list(llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
    return tokens, llm.engine.stats()["external_prefix_hits"] - before


@pytest.mark.parametrize("level", [1, 2])
def test_sleeping_keeps_the_offloaded_blocks_valid(llm, checkpoints, level):
    want = reference.hf_greedy(checkpoints[1]["a"], [PROMPT], GREEDY.max_tokens)[0]
    assert run(llm)[0] == want  # its four full blocks are ordered saved as it finishes
    llm.sleep(level=level)  # carries the saves out, then releases the pool they came from
    llm.wake_up()
    tokens, from_tier = run(llm)
    assert from_tier == 4 * BLOCK, "waking forgot the pool's prefix cache, not the tier's blocks"
    assert tokens == want


def test_a_weight_update_forgets_the_offloaded_blocks(llm, checkpoints):
    folders, models = checkpoints
    run(llm)
    llm.update_weights_from_disk(folders["b"])
    tokens, from_tier = run(llm)
    assert from_tier == 0, "blocks the old weights computed were offered after the update"
    assert tokens == reference.hf_greedy(models["b"], [PROMPT], GREEDY.max_tokens)[0]
    llm.reset_prefix_cache()  # the pool's own cache only: the tier offers the new weights' blocks
    tokens, from_tier = run(llm)
    assert from_tier == 4 * BLOCK and tokens == reference.hf_greedy(models["b"], [PROMPT], 6)[0]
    llm.update_weights_from_disk(folders["a"])


def test_a_pd_connector_is_refused_sleep_mode_naming_it(checkpoints):
    """Refused after the connector's transport started: the failed start shuts it down (a
    transfer thread left running would outlive the engine)."""
    before = set(threading.enumerate())
    transfer = {"kv_connector": "p2p", "kv_role": "kv_producer", "kv_port": free_port()}
    with pytest.raises(
        ValueError, match="enable_sleep_mode: not with KV connector 'p2p': it implements no reset_cache"
    ):
        LLM(checkpoints[0]["a"], kv_transfer_config=transfer, enable_sleep_mode=True, **OPTIONS)
    assert not [t for t in threading.enumerate() if t.name == "p2p-transport" and t not in before]
