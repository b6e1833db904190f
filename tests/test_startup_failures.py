"""Every start-up failure of `engine serve` is one line naming the cause and the fix: a port
another server holds (refused before anything loads), a model no plugin serves, a KV cache larger
than the machine, an unknown flag; and `--plugins` works after the command as before it."""

from __future__ import annotations

import re
import socket
import subprocess
import time

import pytest

from tests.serving import ENGINE

ARGS = ("--dtype", "float32", "--max-model-len", "256")
PLUGINS = "models-llama,attention-torch,server"


def serve(*args: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    run = subprocess.run(
        [ENGINE, "serve", *args], check=False, capture_output=True, text=True, timeout=timeout
    )
    return run, time.monotonic() - started


def assert_one_line(run: subprocess.CompletedProcess, *words: str) -> None:
    """The error is one line; the loading progress bars before it do not count."""
    lines = [line for line in re.split(r"[\r\n]", run.stderr) if line.strip() and "%|" not in line]
    assert run.returncode != 0 and len(lines) == 1, run.stderr
    assert all(word in lines[0] for word in words), lines[0]


def test_a_port_taken_is_one_line_before_the_model_loads(tiny_llama):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        run, seconds = serve(tiny_llama[0], *ARGS, "--port", port, "--plugins", PLUGINS)
    assert_one_line(run, f"127.0.0.1:{port} is already in use", "pick another --port")
    assert seconds < 30  # no model was loaded first


@pytest.mark.slow  # an engine-core start of its own
def test_a_kv_cache_larger_than_the_machine_is_one_line(tiny_llama):
    too_big = ("--kv-cache-memory-bytes", "64TiB")
    run, _ = serve(tiny_llama[0], *ARGS, "--port", "0", *too_big, "--plugins", PLUGINS)
    assert_one_line(run, "engine failed to start", "65536.0 GiB does not fit", "--kv-cache-memory-bytes")


def test_a_model_no_plugin_serves_is_one_line(tiny_llama):
    run, _ = serve(tiny_llama[0], *ARGS, "--port", "0", "--plugins", "models-qwen3,attention-torch,server")
    assert_one_line(run, "engine serve:", "no installed model plugin serves", "LlamaForCausalLM")


def test_an_unknown_flag_is_one_line_and_ends_the_core_started_early(tiny_llama):
    """`engine serve` starts its engine core before it parses its flags (so both import side by
    side); a flag it then refuses ends that core too, quietly: ``run`` returns only once every
    holder of its output pipes has exited, the core included."""
    run, seconds = serve(tiny_llama[0], "--no-such-flag", "--plugins", PLUGINS)
    assert_one_line(run, "unknown flag --no-such-flag")
    assert seconds < 60
