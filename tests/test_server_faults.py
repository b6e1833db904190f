"""Lifecycle faults: the engine-core process dies mid-stream (error frames, 5xx, /health 503,
non-zero exit instead of a hang), and SIGTERM lets in-flight requests finish."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from tests.serving import serve


@pytest.mark.slow
def test_engine_core_death_fails_requests_cleanly_and_exits_nonzero():
    with serve(None, "--max-model-len", "4096", "--num-blocks", "512", api_key=None) as server:
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        outcome = {}

        def blocking_request():
            response = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
                "model": model, "prompt": "Count:", "max_tokens": 3000, "ignore_eos": True})
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
    args = ("--dtype", "float32", "--num-blocks", "64", "--max-model-len", "256")
    with serve(tiny_llama[0], *args, api_key=None) as server:
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
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
