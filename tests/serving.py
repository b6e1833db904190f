"""Start a real `engine serve` in a subprocess on a free port and wait until it is healthy."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from engine.testing.ports import free_port

ENGINE = os.path.join(os.path.dirname(sys.executable), "engine")
API_KEY = "test-key"
# between /health polls while a server starts: a refused connection costs the poll nothing, and
# the wait past the moment it is ready (half this on average) is paid at every one of the suite's
# ~100 server starts
HEALTH_POLL_S = 0.1


class Server:
    def __init__(self, process: subprocess.Popen, port: int, api_key: str | None):
        self.process, self.port, self.api_key = process, port, api_key
        self.url = f"http://127.0.0.1:{port}"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=120, **kwargs)

    def openai(self, cls=None):
        import openai

        return (cls or openai.OpenAI)(
            base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0
        )

    def core_pid(self) -> int:
        with open(f"/proc/{self.process.pid}/task/{self.process.pid}/children") as f:
            return int(f.read().split()[0])

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics", headers=self.headers).text.splitlines():
            if line.startswith((name + "{", name + " ")):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def wait_for_metric(self, name: str, predicate, timeout: float = 30) -> float:
        deadline = time.monotonic() + timeout
        while not predicate(value := self.metric(name)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} stayed at {value}")
            time.sleep(0.05)
        return value

    def model(self) -> str:
        return httpx.get(f"{self.url}/v1/models", headers=self.headers).json()["data"][0]["id"]


class Streams:
    """``count`` streaming completions, each read by its own thread into ``frames[i]`` (the
    ``data:`` payloads, ``[DONE]`` included); :meth:`wait_started` returns once every one has
    its first frame, so whatever the test does next happens mid-stream."""

    def __init__(self, server: Server, count: int, **body):
        body = {"model": server.model(), "prompt": "Hello", "ignore_eos": True, "stream": True, **body}
        self.frames: list[list[str]] = [[] for _ in range(count)]
        self.statuses: list[int | None] = [None] * count
        self._started = [threading.Event() for _ in range(count)]
        self._threads = [
            threading.Thread(target=self._read, args=(server, i, body), daemon=True) for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def _read(self, server: Server, i: int, body: dict) -> None:
        try:
            with httpx.stream(
                "POST", f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=120
            ) as response:
                self.statuses[i] = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.frames[i].append(line[6:])
                        self._started[i].set()
        except httpx.HTTPError as exc:  # recorded as the stream's last frame, for the assertion message
            self.frames[i].append(f"client error: {exc!r}")
        finally:
            self._started[i].set()

    def wait_started(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        for event in self._started:
            assert event.wait(max(0.0, deadline - time.monotonic())), "a stream did not start"

    def join(self, timeout: float = 60) -> list[list[str]]:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self._threads), "a stream did not end"
        return self.frames


def error_codes(frames: list[str]) -> list[str | None]:
    """The ``error.code`` of every error frame of one stream."""
    payloads = [json.loads(f) for f in frames if f.startswith("{")]
    return [p["error"]["code"] for p in payloads if "error" in p]


def gone(pid: int, timeout: float = 5) -> bool:
    """Whether process ``pid`` exits within ``timeout`` (a zombie left to a non-reaping init
    counts as exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def serve(
    model: str | None,
    *args: str,
    api_key: str | None = API_KEY,
    timeout: float = 240,
    new_session: bool = False,
    port: int | None = None,
    env: dict[str, str] | None = None,
):
    """``new_session``: the server leads its own process group, for signals sent to the group.
    ``port``: where it listens (default: a free port), for a test that must name it before it starts.
    ``env``: the server's environment (default: this process's), e.g. with a plugin on its path."""
    port = port or free_port()
    command = [ENGINE, "serve", "--port", str(port), *(["--model", model] if model else []), *args]
    if api_key:
        command += ["--api-key", api_key]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=new_session,
        env=env,
    )
    server = Server(process, port, api_key)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"server exited with {process.returncode}: {process.stdout.read()[-3000:]}"
                )
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("server did not become healthy")
            time.sleep(HEALTH_POLL_S)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def streamed_calls(chunks) -> list[dict]:
    """The tool calls an openai SDK chat stream builds, reassembled by index as a client does:
    each call's ``name`` and ``arguments``, ``argument_deltas`` (how many chunks carried some) and
    ``named_first`` (the name came before the last of them)."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(delta.index, {"arguments": "", "argument_deltas": 0})
            if delta.function.name:
                assert "name" not in call, f"call {delta.index} named twice"
                call["name"], call["named_first"] = delta.function.name, True
            if delta.function.arguments:
                call["arguments"] += delta.function.arguments
                call["argument_deltas"] += 1
                call.setdefault("named_first", False)
    return [calls[i] for i in sorted(calls)]
