"""Sleep mode and weight updates at ``tensor_parallel_size=2`` with the ``mp`` executor (rank 1 a
worker process, real gloo; and once with ``ray``): every rank gives its memory back at level 1
and 2 (each rank's resident set measured) and waking gives the same greedy tokens; a checkpoint
from disk, each rank loading its share, and a trainer process broadcasting whole tensors to both
ranks over a gloo group of three, each give the new checkpoint's ``transformers`` tokens; a
refused update changes no rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
from safetensors import safe_open

from engine import LLM, SamplingParams
from engine.executors.sleep_call import Outcome, results
from engine.interfaces import ExecutorFailure
from engine.messages.step import Overloaded
from engine.testing import reference
from engine.testing.ports import free_port
from tests.conftest import TINY_LLAMA

BIGGER = dict(TINY_LLAMA, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8)
PROMPTS = [[1, 5, 9, 200, 31], [1, 77, 3000, 12, 12, 8, 40]]
GREEDY = SamplingParams(temperature=0, max_tokens=6)
MiB = 1 << 20

# The trainer: plain torch, none of the engine. It hosts the group's store as rank 0 of
# 1 + 2 engine ranks, "trains" (every weight moves), broadcasts each tensor whole under its
# checkpoint name, in the order the engine was told, and saves the result for the test to compare.
TRAINER = """
import datetime, json, sys, torch, torch.distributed as dist
from transformers import AutoModelForCausalLM
source, port, world_size, names, target = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
with torch.no_grad():
    for p in model.parameters():
        p.mul_(-1.5)
state = model.state_dict()
timeout = datetime.timedelta(seconds=120)
store = dist.TCPStore("127.0.0.1", int(port), int(world_size), True, timeout=timeout, wait_for_workers=False)
group = dist.ProcessGroupGloo(dist.PrefixStore("sync", store), 0, int(world_size), timeout)
for name in json.loads(names):
    group.broadcast(state[name].contiguous(), 0).wait()
model.save_pretrained(target, safe_serialization=True)
print("sent")
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folders = {name: str(tmp_path_factory.mktemp(name)) for name in ("a", "b", "other")}
    models = {
        "a": reference.tiny_checkpoint(folders["a"], "LlamaForCausalLM", BIGGER, seed=0),
        "b": reference.tiny_checkpoint(folders["b"], "LlamaForCausalLM", BIGGER, seed=1),
    }
    reference.tiny_checkpoint(folders["other"], "LlamaForCausalLM", TINY_LLAMA, seed=2)
    return folders, models


@pytest.fixture(scope="module")
def llm(checkpoints):
    engine = LLM(
        checkpoints[0]["a"],
        dtype="float32",
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        kv_cache_memory=64 * MiB,
        enable_sleep_mode=True,
    )
    yield engine
    engine.engine.shutdown()


def resident(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rank_pids(llm) -> list[int]:
    return [os.getpid(), *(handle.pid for handle in llm.engine.executor.workers.handles)]


def greedy(llm) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_every_rank_gives_memory_back_and_waking_gives_the_same_tokens(llm, checkpoints):
    want = reference.hf_greedy(checkpoints[1]["a"], PROMPTS, GREEDY.max_tokens)
    assert greedy(llm) == want
    share = llm.engine.startup.memory["weights"]  # rank 0's share (~31 MiB: half, and the whole norms)
    pids = rank_pids(llm)
    for level in (1, 2):
        before = [resident(pid) for pid in pids]
        llm.sleep(level=level)
        after = [resident(pid) for pid in pids]
        released = [b - a for b, a in zip(before, after)]
        print(
            f"level {level}: resident MiB per rank before -> asleep:",
            [f"{b / MiB:.1f} -> {a / MiB:.1f}" for b, a in zip(before, after)],
        )
        for rank, freed in enumerate(released):
            assert freed >= 0.9 * share, f"rank {rank} gave back only {freed / MiB:.1f} MiB at level {level}"
        with pytest.raises(Overloaded, match="asleep"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        llm.wake_up()
        assert greedy(llm) == want, f"after waking from level {level}"


def test_weights_from_disk_reach_every_rank(llm, checkpoints):
    folders, models = checkpoints
    for name in ("b", "a"):
        llm.update_weights_from_disk(folders[name])
        assert greedy(llm) == reference.hf_greedy(models[name], PROMPTS, GREEDY.max_tokens), name


def test_an_update_while_asleep_at_level_2_is_what_every_rank_wakes_to(llm, checkpoints):
    folders, models = checkpoints
    llm.sleep(level=2)
    llm.update_weights_from_disk(folders["b"])
    llm.wake_up()
    assert greedy(llm) == reference.hf_greedy(models["b"], PROMPTS, GREEDY.max_tokens)
    llm.update_weights_from_disk(folders["a"])


def test_weights_that_do_not_fit_are_refused_on_every_rank_and_the_old_ones_stay(llm, checkpoints):
    folders, models = checkpoints
    with pytest.raises(ValueError, match="do not fit the served model"):
        llm.update_weights_from_disk(folders["other"])
    assert greedy(llm) == reference.hf_greedy(models["a"], PROMPTS, GREEDY.max_tokens)


def test_a_trainer_broadcasts_whole_tensors_and_each_rank_keeps_its_share(llm, checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = checkpoints[0]["a"]
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        names = sorted(f.keys())
        shapes = [list(f.get_slice(name).get_shape()) for name in names]
    port, target = free_port(), str(tmp_path / "trained")
    trainer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(TRAINER), folder, str(port), "3", json.dumps(names), target],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        llm.init_weights_update_group("127.0.0.1", port, 1, 3, "sync", "gloo")
        llm.update_weights_from_distributed(names, ["float32"] * len(names), shapes)
        out, err = trainer.communicate(timeout=300)
        assert trainer.returncode == 0 and "sent" in out, err
        trained = AutoModelForCausalLM.from_pretrained(target).eval()
        assert greedy(llm) == reference.hf_greedy(trained, PROMPTS, GREEDY.max_tokens)
    finally:
        trainer.kill()
        llm.destroy_weights_update_group()
        llm.update_weights_from_disk(folder)


def test_a_group_too_small_for_every_rank_is_refused(llm):
    with pytest.raises(ValueError, match=r"rank_offset 1 .* ranks 1\.\.2 must lie below world_size=2"):
        llm.init_weights_update_group("127.0.0.1", free_port(), 1, 2, "sync", "gloo")


def test_a_multi_rank_executor_without_sleep_mode_call_is_refused_sleep_mode(checkpoints):
    """Refused after its workers started: the failed start shuts the executor down, so no
    keep-alive thread (nor worker) is left running."""
    before = set(threading.enumerate())
    with pytest.raises(
        ValueError, match="enable_sleep_mode: executor 'test-mp-v2' runs sleep-mode calls on rank 0 only"
    ):
        LLM(
            checkpoints[0]["a"],
            dtype="float32",
            tensor_parallel_size=2,
            distributed_executor_backend="test-mp-v2",
            kv_cache_memory=16 * MiB,
            enable_sleep_mode=True,
        )
    assert not [t for t in threading.enumerate() if t.name == "engine-tp-keepalive" and t not in before]


def test_the_ray_executor_sleeps_and_updates_every_rank(checkpoints, ray_cluster):
    """Ray's actors run the same worker as ``mp``'s processes, sleep-mode calls included."""
    folders, models = checkpoints
    llm = LLM(
        folders["a"],
        dtype="float32",
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        kv_cache_memory=16 * MiB,
        enable_sleep_mode=True,
    )
    try:
        want = reference.hf_greedy(models["a"], PROMPTS, GREEDY.max_tokens)
        llm.sleep(level=2)
        llm.wake_up()
        assert greedy(llm) == want
        llm.update_weights_from_disk(folders["b"])
        assert greedy(llm) == reference.hf_greedy(models["b"], PROMPTS, GREEDY.max_tokens)
    finally:
        llm.engine.shutdown()


def test_rank_outcomes_name_the_rank_that_failed_unless_all_failed_alike():
    assert results([Outcome(3), Outcome(4)]) == [3, 4]
    with pytest.raises(ValueError, match=r"^rank 1: cannot read x$"):
        results([Outcome(None), Outcome(error="cannot read x")])
    with pytest.raises(ValueError, match=r"^do not fit$"):
        results([Outcome(error="do not fit"), Outcome(error="do not fit")])
    with pytest.raises(ValueError, match=r"^rank 0: a; rank 1: b$"):
        results([Outcome(error="a"), Outcome(error="b")])
    with pytest.raises(ExecutorFailure, match="rank 1: gather timed out"):
        results([Outcome(None), Outcome(error="gather timed out", fatal=True)])
