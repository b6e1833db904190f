"""Sleep mode and weight updates on a real `engine serve`: ``/sleep`` waits for the streams in
flight (they finish whole) while new requests get 503 with ``Retry-After``, the engine core's
resident memory drops, ``/wake_up`` serves the same tokens again; a trainer in another process
saves new weights and posts ``/update_weights_from_disk``, after which the server's greedy tokens
are the new checkpoint's in ``transformers``; another broadcasts them over a gloo group
(``/init_weights_update_group``, ``/update_weights_from_distributed``), with the same result;
``/reset_prefix_cache``; bad calls are 400s. With ``--tensor-parallel-size 2`` every rank's
resident memory drops asleep, and both trainers' updates reach both ranks (the gloo group then
has three members)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import httpx
import pytest

from engine.testing import reference
from engine.testing.ports import free_port
from tests.conftest import TINY_LLAMA
from tests.serving import Streams, error_codes, serve

pytestmark = pytest.mark.slow

ARGS = ("--dtype", "float32", "--kv-cache-memory-bytes", "96MiB", "--max-model-len", "512")
PROMPT = [1, 9, 300, 41, 7, 7, 1200]
MiB = 1 << 20
HI = {"prompt": "Hi", "max_tokens": 2}
GROUP = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}

TRAINER = """
import sys, httpx, torch
from transformers import AutoModelForCausalLM
url, key, source, target = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
with torch.no_grad():  # one "training step": every weight moves
    for p in model.parameters():
        p.mul_(-1.5)
model.save_pretrained(target, safe_serialization=True)
reply = httpx.post(url + "/update_weights_from_disk", json={"model_path": target},
                   headers={"Authorization": "Bearer " + key}, timeout=120)
print(reply.status_code, reply.text)
"""


TRAINER_OVER_GLOO = """
import datetime, os, sys, threading, httpx, torch, torch.distributed as dist
from safetensors import safe_open
from transformers import AutoModelForCausalLM
url, key, source, port, target, world_size = sys.argv[1:]
world_size = int(world_size)  # the trainer and one rank per tensor-parallel rank of the engine
model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
with torch.no_grad():  # one "training step": every weight moves
    for p in model.parameters():
        p.mul_(-1.5)
state = model.state_dict()
with safe_open(os.path.join(source, "model.safetensors"), "pt") as f:
    names = sorted(f.keys())  # the checkpoint's names (a tied LM head is not among them)
headers, replies = {"Authorization": "Bearer " + key}, []
def post(path, body):
    replies.append(httpx.post(url + path, json=body, headers=headers, timeout=120))
timeout = datetime.timedelta(seconds=60)
store = dist.TCPStore("127.0.0.1", int(port), world_size, True, timeout=timeout, wait_for_workers=False)
join = {"master_address": "127.0.0.1", "master_port": int(port), "rank_offset": 1, "world_size": world_size,
        "group_name": "sync", "backend": "gloo"}
joining = threading.Thread(target=post, args=("/init_weights_update_group", join))
joining.start()
group = dist.ProcessGroupGloo(dist.PrefixStore("sync", store), 0, world_size, timeout)
joining.join()
update = {"names": names, "dtypes": ["float32"] * len(names), "shapes": [list(state[n].shape) for n in names]}
updating = threading.Thread(target=post, args=("/update_weights_from_distributed", update))
updating.start()
for name in names:
    group.broadcast(state[name].contiguous(), 0).wait()
updating.join()
post("/destroy_weights_update_group", None)
model.save_pretrained(target, safe_serialization=True)  # for the test to compare
print(*(r.status_code for r in replies), *(r.text for r in replies))
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_tokenizer):
    folder = str(tmp_path_factory.mktemp("served"))
    reference.tiny_checkpoint(folder, "LlamaForCausalLM", TINY_LLAMA, tokenizer=default_tokenizer)
    with serve(folder, *ARGS, "--enable-sleep-mode", "--enable-prompt-tokens-details") as s:
        s.folder = folder
        yield s


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory, default_tokenizer):
    """The same on two tensor-parallel ranks (``mp``: the engine core and one worker process)."""
    folder = str(tmp_path_factory.mktemp("served-tp"))
    reference.tiny_checkpoint(folder, "LlamaForCausalLM", TINY_LLAMA, tokenizer=default_tokenizer)
    with serve(folder, *ARGS, "--enable-sleep-mode", "--tensor-parallel-size", "2") as s:
        s.folder = folder
        yield s


def greedy(server, prompt=PROMPT, max_tokens=8) -> dict:
    body = {"model": server.model(), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    with server.http() as http:
        reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def resident(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def core_resident(server) -> int:
    return resident(server.core_pid())


def rank_pids(server) -> list[int]:
    """The engine core (rank 0) and the worker ranks it started."""
    core = server.core_pid()
    with open(f"/proc/{core}/task/{core}/children") as f:
        return [core, *(int(pid) for pid in f.read().split())]


def trained_tokens(server, target: str) -> tuple[list[int], list[int]]:
    """(the server's greedy token ids, ``transformers``' on the checkpoint at ``target``)."""
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(target).eval()
    body = {"model": server.model(), "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0}
    with server.http() as http:
        choice = http.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True}).json()
    tokens = choice["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens], reference.hf_greedy(trained, [PROMPT], 8)[0]


def run_trainer(server, script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), server.url, server.api_key, server.folder, *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_sleep_lets_streams_finish_refuses_new_requests_and_wakes_to_the_same_tokens(server):
    before_text = greedy(server)["choices"][0]["text"]
    streams = Streams(server, 2, max_tokens=150)
    streams.wait_started()
    resident = core_resident(server)
    slept: list[httpx.Response] = []
    sleeper = threading.Thread(
        target=lambda: slept.append(server.http().post("/sleep", params={"level": 1})), daemon=True
    )
    sleeper.start()
    with server.http() as http:
        refused = None
        while sleeper.is_alive() and refused is None:  # the sleep waits for the two streams
            reply = http.post("/v1/completions", json=HI | {"model": server.model()})
            refused = reply if reply.status_code == 503 else None
        sleeper.join(60)
        assert slept and slept[0].status_code == 200, slept
        for frames in streams.join():
            assert frames[-1] == "[DONE]" and not error_codes(frames), frames[-3:]
        assert refused is not None and refused.headers["Retry-After"] and "about to sleep" in refused.text
        try:
            assert http.get("/is_sleeping").json() == {"is_sleeping": True}
            # the weights (12 MiB, the tied embedding) and the KV pages the streams wrote, less
            # what the process allocated meanwhile (a few hundred KiB of request handling: the
            # drop measured 11.88-12.4 MiB); the pool's untouched pages were never resident
            assert resident - core_resident(server) > 11 * MiB
            asleep = http.post("/v1/completions", json=HI | {"model": server.model()})
            assert asleep.status_code == 503 and "asleep" in asleep.text and asleep.headers["Retry-After"]
        finally:
            assert http.post("/wake_up").status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert greedy(server)["choices"][0]["text"] == before_text


@pytest.mark.parametrize("engine", ["server", "tp_server"])
def test_a_trainer_process_updates_the_weights(engine, tmp_path, request):
    """One rank, and two (each loads its share of the new checkpoint)."""
    server = request.getfixturevalue(engine)
    target = str(tmp_path / "step-1")
    trainer = run_trainer(server, TRAINER, target)
    assert trainer.stdout.startswith("200"), trainer.stdout + trainer.stderr
    try:
        served, want = trained_tokens(server, target)
        assert served == want
    finally:
        with server.http() as http:
            assert (
                http.post("/update_weights_from_disk", json={"model_path": server.folder}).status_code == 200
            )


@pytest.mark.parametrize("engine", ["server", "tp_server"])
def test_a_trainer_broadcasts_new_weights_over_gloo(engine, tmp_path, request):
    """One rank, and two (the group then has three members: every rank receives each tensor)."""
    server = request.getfixturevalue(engine)
    world_size = 2 if engine == "server" else 3
    target = str(tmp_path / "broadcast")
    trainer = run_trainer(server, TRAINER_OVER_GLOO, str(free_port()), target, str(world_size))
    assert trainer.stdout.startswith("200 200 200"), trainer.stdout + trainer.stderr
    try:
        served, want = trained_tokens(server, target)
        assert served == want
    finally:
        with server.http() as http:
            assert (
                http.post("/update_weights_from_disk", json={"model_path": server.folder}).status_code == 200
            )


def test_every_tensor_parallel_rank_sleeps_and_wakes_to_the_same_tokens(tp_server):
    before_text = greedy(tp_server)["choices"][0]["text"]
    pids = rank_pids(tp_server)
    assert len(pids) == 2, pids
    for level in (1, 2):
        before = [resident(pid) for pid in pids]
        with tp_server.http() as http:
            assert http.post("/sleep", params={"level": level}).status_code == 200
            assert http.get("/is_sleeping").json() == {"is_sleeping": True}
            released = [b - resident(pid) for b, pid in zip(before, pids)]
            asleep = http.post("/v1/completions", json=HI | {"model": tp_server.model()})
            assert asleep.status_code == 503 and asleep.headers["Retry-After"]
            assert http.post("/wake_up").status_code == 200
        # each rank's share of the weights (its half of the 12 MiB tied embedding, and the rest)
        assert all(r > 5 * MiB for r in released), f"level {level}: released {released}"
        assert greedy(tp_server)["choices"][0]["text"] == before_text


def test_reset_prefix_cache_forgets_cached_prompts(server):
    prompt = list(range(1, 80))
    greedy(server, prompt, 1)
    assert greedy(server, prompt, 1)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    with server.http() as http:
        assert http.post("/reset_prefix_cache").status_code == 200
    assert greedy(server, prompt, 1)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize(
    "path, params, body, words",
    [
        ("/sleep", {"level": "3"}, None, "level must be 1 or 2"),
        ("/update_weights_from_disk", None, {}, "'model_path' must be provided"),
        ("/update_weights_from_disk", None, {"model_path": "/nonexistent/ckpt"}, "nonexistent"),
        (
            "/update_weights_from_distributed",
            None,
            {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]},
            "first",
        ),
        ("/update_weights_from_distributed", None, {}, "'names'"),
        ("/init_weights_update_group", None, GROUP | {"rank_offset": 0}, "rank_offset 0"),
        ("/init_weights_update_group", None, GROUP | {"backend": "nccl"}, "backend 'nccl'"),
    ],
)
def test_bad_calls_are_400s_and_change_nothing(server, path, params, body, words):
    before = greedy(server)["choices"][0]["text"]
    with server.http() as http:
        reply = http.post(path, params=params, json=body)
    assert reply.status_code == 400 and words in reply.json()["error"]["message"], reply.text
    assert greedy(server)["choices"][0]["text"] == before
