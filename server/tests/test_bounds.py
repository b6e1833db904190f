"""The hardening bounds without a server: the default queue bound, stale IPC folders, the Host
allow-list, the per-key cache salt and the request budget's refusal."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from engine.client.mp_client import remove_stale_ipc_dirs
from engine.config import AUTO_QUEUE, MIN_AUTO_QUEUE, SchedulerConfig, auto_queue_bound
from engine.entrypoints.cli_args import parse_queue_bound
from engine_server.app import ServerState
from engine_server.bounds import budget_units, check_budget, salted
from engine_server.errors import APIError
from engine_server.guard import Guard, default_allowed_hosts, host_allowed, host_name


def test_auto_queue_bound_is_two_batches_and_at_least_the_floor():
    assert auto_queue_bound(256, 10**7, 4096) == 512  # the batch is max_num_seqs
    assert auto_queue_bound(256, 64 * 4096, 4096) == 128  # the KV cache holds 64 full-context requests
    assert auto_queue_bound(4, 4096, 64) == MIN_AUTO_QUEUE
    assert parse_queue_bound("auto") == AUTO_QUEUE and parse_queue_bound("32") == 32
    assert SchedulerConfig(max_queued_requests=AUTO_QUEUE).max_queued_requests == AUTO_QUEUE
    with pytest.raises(ValueError, match="non-negative or auto"):
        SchedulerConfig(max_queued_requests=-2)


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_stale_ipc_folders_of_dead_processes_are_removed(tmp_path):
    dead = tmp_path / f"engine-ipc-{_dead_pid()}-abc"
    alive = tmp_path / f"engine-ipc-{os.getpid()}-def"
    legacy_dead, legacy_live, young = (tmp_path / f"engine-ipc-{n}" for n in ("old1", "old2", "new3"))
    other = tmp_path / "unrelated-123-x"
    for folder in (dead, alive, legacy_dead, legacy_live, young, other):
        folder.mkdir()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(legacy_live / "to-core"))
    listener.listen()
    unbound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unbound.bind(str(legacy_dead / "to-core"))  # a socket file nobody listens on: its owner died
    unbound.close()
    old = time.time() - 3600
    for folder in (legacy_dead, legacy_live):
        os.utime(folder, (old, old))
    try:
        removed = remove_stale_ipc_dirs(str(tmp_path))
    finally:
        listener.close()
    assert sorted(removed) == sorted([str(dead), str(legacy_dead)])
    assert alive.exists() and legacy_live.exists() and young.exists() and other.exists()


def test_host_allow_list():
    assert default_allowed_hosts("127.0.0.1", None) == ["localhost", "127.0.0.1", "::1"]
    assert default_allowed_hosts("0.0.0.0", None) is None
    assert default_allowed_hosts("0.0.0.0", ["API.example."]) == ["api.example"]
    assert default_allowed_hosts("127.0.0.1", ["*"]) is None
    assert [host_name(h) for h in (b"[::1]:8000", b"LocalHost:80", b"example.com.", b"::1")] == [
        "::1",
        "localhost",
        "example.com",
        "::1",
    ]
    assert host_allowed("a.example.com", ["*.example.com"]) and not host_allowed(
        "example.com.evil", ["*.example.com"]
    )


def _scope(key: str | None, host: bytes = b"127.0.0.1:8000") -> dict:
    headers = [(b"host", host)] + ([(b"authorization", f"Bearer {key}".encode())] if key else [])
    return {"type": "http", "method": "GET", "path": "/v1/models", "headers": headers}


def test_each_key_gets_its_own_cache_salt_unless_disabled():
    state = ServerState(None, None, "m", 64, 100, None, api_keys=("k1", "k2"), allowed_hosts=["127.0.0.1"])
    guard = Guard(None, state, frozenset())
    scopes = [_scope("k1"), _scope("k1"), _scope("k2")]
    assert [guard.refusal(scope) for scope in scopes] == [None] * 3
    salts = [scope["state"]["tenant_salt"] for scope in scopes]
    assert salts[0] == salts[1] != salts[2] and "k1" not in salts[0]
    assert salted(salts[0], "mine") == f"{salts[0]}:mine" and salted(None, "mine") == "mine"
    assert guard.refusal(_scope("k3")).status == 401
    assert guard.refusal(_scope("k1", b"evil.example")).status == 421
    state.api_key_cache_salt = False
    scope = _scope("k1")
    assert Guard(None, state, frozenset()).refusal(scope) is None and "state" not in scope


def test_request_budget_names_the_product_and_the_limit():
    state = ServerState(None, None, "m", 64, 100, None, max_request_budget=100_000)
    assert budget_units(32, [2000], 16, 20) == 32 * 2016 * 21
    check_budget(state, 1, [2000], 16, 20, "logprobs")
    with pytest.raises(APIError) as error:
        check_budget(state, 32, [2000], 16, 20, "prompt_logprobs")
    message = error.value.message
    assert error.value.status == 400 and error.value.param == "prompt_logprobs"
    assert "32 x (2000 prompt tokens + 16) x (20 + 1) = 1354752" in message and "100000" in message
    state.max_request_budget = 0
    check_budget(state, 32, [2000], 16, 20, "prompt_logprobs")
