"""Lifecycle faults: the engine-core process dies mid-stream (error frames, 5xx, /health 503,
non-zero exit instead of a hang), SIGTERM (to the server or its whole process group) lets
in-flight requests finish, a drain cut short by --graceful-timeout ends them with an error,
and the core never outlives the API process; plus a short run of benchmarks/soak.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.plugin_packages import pip_install, pip_uninstall, write_plugin
from tests.serving import Streams, error_codes, gone, serve

FAULT_PLUGIN = '''\
"""test-fault: a logits processor that paces every step by {pace} s (so tiny-model streams
are still running when a test acts) and raises on every call once {trigger} exists: a
fault no single request explains, which the engine core treats as fatal."""

import os
import re
import time

from engine import hookimpl
from engine.interfaces import LogitsProcessor


@hookimpl
def register_logits_processors(register):
    register("test-fault", Fault, api=1)


class Fault(LogitsProcessor):
    def apply(self, logits, requests):
        if os.path.exists({trigger!r}):
            raise RuntimeError("injected fault")
        time.sleep({pace!r})
        return logits
'''

# the tiny model with the fault plugin; 16 streams of 400 tokens fit in 512 blocks of 16
TINY = (
    "--dtype",
    "float32",
    "--num-blocks",
    "512",
    "--max-model-len",
    "512",
    "--logits-processors",
    "test-fault",
)


@pytest.fixture(scope="module")
def fault_trigger(tmp_path_factory):
    """Installs the test-fault plugin into this environment (the server finds plugins by
    their installed entry points) for this module; yields the file that arms it."""
    root = tmp_path_factory.mktemp("fault-plugin")
    trigger = root / "raise"
    source = FAULT_PLUGIN.format(trigger=str(trigger), pace=0.01)
    pip_install(
        write_plugin(root, "tessellm-logits-test-fault", "test-fault", "engine_logits_test_fault", source)
    )
    yield trigger
    pip_uninstall("tessellm-logits-test-fault")


@pytest.mark.slow
def test_injected_core_exception_ends_every_stream_and_exits_nonzero_ten_times(tiny_llama, fault_trigger):
    for attempt in range(10):
        fault_trigger.unlink(missing_ok=True)
        with serve(tiny_llama[0], *TINY, api_key=None) as server:
            core = server.core_pid()
            streams = Streams(server, 16, max_tokens=400)
            streams.wait_started()
            fault_trigger.touch()
            triggered = time.monotonic()
            for frames in streams.join(timeout=30):
                assert error_codes(frames) == ["engine_dead"] and frames[-1] == "[DONE]", (
                    attempt,
                    frames[-3:],
                )
            code = server.process.wait(30)
            exited_after = time.monotonic() - triggered
            assert code != 0 and exited_after < 5, (attempt, code, exited_after)
            assert gone(core)


def test_sigterm_to_the_process_group_drains_every_stream(tiny_llama, fault_trigger):
    fault_trigger.unlink(missing_ok=True)
    with serve(tiny_llama[0], *TINY, "--graceful-timeout", "60", api_key=None, new_session=True) as server:
        core = server.core_pid()
        streams = Streams(server, 16, max_tokens=100, stream_options={"include_usage": True})
        streams.wait_started()
        os.killpg(server.process.pid, signal.SIGTERM)
        for frames in streams.join():
            assert frames[-1] == "[DONE]" and not error_codes(frames), frames[-3:]
            assert json.loads(frames[-2])["usage"]["completion_tokens"] == 100
        assert server.process.wait(30) == 0
        assert gone(core)


def test_drain_cut_short_ends_requests_with_an_error_and_exits_nonzero(tiny_llama, fault_trigger):
    fault_trigger.unlink(missing_ok=True)
    with serve(tiny_llama[0], *TINY, "--graceful-timeout", "1", api_key=None) as server:
        outcome = {}

        def complete():
            response = httpx.post(
                f"{server.url}/v1/completions",
                timeout=60,
                json={"model": server.model(), "prompt": "Hi", "max_tokens": 400, "ignore_eos": True},
            )
            outcome["status"], outcome["body"] = response.status_code, response.json()

        thread = threading.Thread(target=complete)
        thread.start()
        streams = Streams(server, 4, max_tokens=400)
        streams.wait_started()
        server.wait_for_metric("vllm:num_requests_running", lambda running: running == 5)
        server.process.send_signal(signal.SIGTERM)
        for frames in streams.join(timeout=30):
            assert error_codes(frames) == ["shutdown"] and frames[-1] == "[DONE]", frames[-3:]
        thread.join(30)
        assert outcome["status"] == 503 and outcome["body"]["error"]["code"] == "shutdown"
        assert server.process.wait(30) == 1


def test_engine_core_exits_when_the_api_process_dies(tiny_llama):
    with serve(tiny_llama[0], "--dtype", "float32", "--num-blocks", "64", api_key=None) as server:
        core = server.core_pid()
        server.process.kill()
        server.process.wait(10)
        assert gone(core)


@pytest.mark.slow
def test_engine_core_death_fails_requests_cleanly_and_exits_nonzero():
    with serve(None, "--max-model-len", "4096", "--num-blocks", "512", api_key=None) as server:
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        outcome = {}

        def blocking_request():
            response = httpx.post(
                f"{server.url}/v1/completions",
                timeout=120,
                json={"model": model, "prompt": "Count:", "max_tokens": 3000, "ignore_eos": True},
            )
            outcome["status"], outcome["body"] = response.status_code, response.json()

        thread = threading.Thread(target=blocking_request)
        thread.start()
        body = {"model": model, "prompt": "Count:", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            first = json.loads(next(lines)[6:])
            assert first["choices"][0]["finish_reason"] is None
            os.kill(server.core_pid(), signal.SIGKILL)
            rest = list(lines)
        errors = [json.loads(line[6:]) for line in rest if line != "data: [DONE]" and "error" in line]
        assert errors and errors[0]["error"]["code"] == "engine_dead" and errors[0]["error"]["message"]
        assert rest[-1] == "data: [DONE]"
        assert httpx.get(f"{server.url}/health").status_code == 503
        thread.join(30)
        assert outcome["status"] == 500 and outcome["body"]["error"]["code"] == "engine_dead"
        assert server.process.wait(30) != 0


def test_sigterm_lets_in_flight_streams_finish(tiny_llama):
    args = ("--dtype", "float32", "--num-blocks", "64", "--max-model-len", "256", "--graceful-timeout", "60")
    with serve(tiny_llama[0], *args, api_key=None) as server:
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        body = {
            "model": model,
            "prompt": "Hello",
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            next(lines)
            server.process.send_signal(signal.SIGTERM)
            rest = list(lines)
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["usage"]["completion_tokens"] == 200
        assert server.process.wait(30) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health", timeout=2)


@pytest.mark.slow
def test_soak_benchmark_short_run_passes(tiny_llama):
    """benchmarks/soak.py end to end, for seconds instead of 30 minutes."""
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "soak.py")
    result = subprocess.run(
        [
            sys.executable,
            script,
            "--model",
            tiny_llama[0],
            "--duration",
            "6",
            "--concurrency",
            "8",
            "--canaries",
            "2",
            "--disconnecters",
            "1",
            "--bad-inputs",
            "1",
            "--input-len",
            "8",
            "--max-tokens",
            "16",
            "--report-every",
            "2",
            "--serve-args=--dtype float32 --num-blocks 128 --max-model-len 256 --batch-invariant",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert (
        lines[-1] == "PASS"
        and ", 0 errors; engine after the load: running 0, waiting 0, KV 0.0%" in lines[-2]
    )
    assert int(lines[-2].split()[0]) >= 4  # every plain stream finished at least one request
    mix = next(line for line in lines if line.startswith("canaries "))
    canaries, disconnects, refused = (int(n) for n in re.findall(r"(\d+) (?:answers|disconnects|bad)", mix))
    assert canaries >= 2 and disconnects >= 1 and refused >= 1 and ", 0 differing;" in mix, mix
