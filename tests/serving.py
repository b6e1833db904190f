"""Start a real `engine serve` in a subprocess on a free port and wait until it is healthy."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

ENGINE = os.path.join(os.path.dirname(sys.executable), "engine")
API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, process: subprocess.Popen, port: int, api_key: str | None):
        self.process, self.port, self.api_key = process, port, api_key
        self.url = f"http://127.0.0.1:{port}"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=120, **kwargs)

    def openai(self, cls=None):
        import openai

        return (cls or openai.OpenAI)(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0)

    def core_pid(self) -> int:
        children = open(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read().split()
        return int(children[0])

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics", headers=self.headers).text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


@contextlib.contextmanager
def serve(model: str | None, *args: str, api_key: str | None = API_KEY, timeout: float = 240):
    port = free_port()
    command = [ENGINE, "serve", "--port", str(port), *(["--model", model] if model else []), *args]
    if api_key:
        command += ["--api-key", api_key]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    server = Server(process, port, api_key)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode}: {process.stdout.read()[-3000:]}")
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("server did not become healthy")
            time.sleep(0.3)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
