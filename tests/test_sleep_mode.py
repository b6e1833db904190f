"""Sleep mode and weight updates through ``LLM`` (the server's routes are in
``server/tests/test_sleep_routes.py``): memory given back at level 1 and 2 (resident set measured),
the same greedy tokens after waking, requests refused while asleep, and a weight update from
disk giving the new checkpoint's ``transformers`` tokens, on the native platform (its recorded
decode tapes keep their addresses) and on the plain one."""

from __future__ import annotations

import os

import pytest

from engine import LLM, SamplingParams
from engine.messages.step import Overloaded
from engine.testing import reference
from tests.conftest import TINY_LLAMA

BIGGER = dict(TINY_LLAMA, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8)
PROMPTS = [[1, 5, 9, 200, 31], [1, 77, 3000, 12, 12, 8, 40]]
GREEDY = SamplingParams(temperature=0, max_tokens=6)
MiB = 1 << 20


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two checkpoints of one architecture (different seeds) and one of another shape."""
    folders = {name: str(tmp_path_factory.mktemp(name)) for name in ("a", "b", "other")}
    models = {
        "a": reference.tiny_checkpoint(folders["a"], "LlamaForCausalLM", BIGGER, seed=0),
        "b": reference.tiny_checkpoint(folders["b"], "LlamaForCausalLM", BIGGER, seed=1),
    }
    reference.tiny_checkpoint(folders["other"], "LlamaForCausalLM", TINY_LLAMA, seed=2)
    return folders, models


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def greedy(llm) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module", params=["cpu-native", "cpu"])
def llm(request, checkpoints):
    native = request.param == "cpu-native"
    return LLM(
        checkpoints[0]["a"],
        dtype="float32",
        device=request.param,
        attention_backend="cpu-native" if native else "torch",
        kv_cache_memory=64 * MiB,
        enable_sleep_mode=True,
    )


def test_sleep_gives_memory_back_and_waking_gives_the_same_tokens(llm, checkpoints):
    want = reference.hf_greedy(checkpoints[1]["a"], PROMPTS, GREEDY.max_tokens)
    assert greedy(llm) == want
    at_least = 0.9 * llm.engine.startup.memory["weights"]  # ~55 MiB; the KV pages written add to it
    for level in (1, 2):
        before = resident()
        llm.sleep(level=level)
        released = before - resident()
        assert released >= at_least, f"level {level} gave back only {released / MiB:.1f} MiB"
        with pytest.raises(Overloaded, match="asleep"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        llm.wake_up()
        assert greedy(llm) == want, f"after waking from level {level}"


def test_weights_from_disk_become_the_served_ones(llm, checkpoints):
    folders, models = checkpoints
    for name in ("b", "a"):
        llm.update_weights_from_disk(folders[name])
        assert greedy(llm) == reference.hf_greedy(models[name], PROMPTS, GREEDY.max_tokens), name


def test_weights_that_do_not_fit_are_refused_and_the_old_ones_stay(llm, checkpoints):
    folders, models = checkpoints
    with pytest.raises(ValueError, match="do not fit the served model"):
        llm.update_weights_from_disk(folders["other"])
    assert greedy(llm) == reference.hf_greedy(models["a"], PROMPTS, GREEDY.max_tokens)


def test_an_update_while_asleep_at_level_2_is_what_waking_serves(llm, checkpoints):
    folders, models = checkpoints
    llm.sleep(level=2)
    llm.update_weights_from_disk(folders["b"])
    llm.wake_up()
    assert greedy(llm) == reference.hf_greedy(models["b"], PROMPTS, GREEDY.max_tokens)
    llm.update_weights_from_disk(folders["a"])


def test_reset_prefix_cache_forgets_the_cached_prompt(llm):
    prompt = list(range(1, 70))
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache()
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_sleep_needs_sleep_mode(tiny_llm):
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        tiny_llm.sleep(level=1)
