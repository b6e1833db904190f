"""A local Ray cluster for the tests: ``ray start --head --block`` on free ports in a short
temporary folder of its own, with a token of its own (Ray's token authentication, so that a
token file a user's earlier Ray run left in ``~/.ray`` cannot make the head and its clients
disagree); ``RAY_ADDRESS`` and the token point this process and the servers it starts at it.
Stopping it ends the processes that ``ray start`` started (never ``ray stop``, which ends
every Ray process on the machine)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

from tests.serving import free_port

STARTED = "Ray runtime started"


@contextlib.contextmanager
def local_cluster(num_cpus: int, timeout_s: float = 180):
    folder = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    port = free_port()
    log_path = os.path.join(folder, "head.log")
    command = [
        os.path.join(os.path.dirname(sys.executable), "ray"),
        "start",
        "--head",
        "--block",
        f"--port={port}",
        f"--num-cpus={num_cpus}",
        "--num-gpus=0",
        f"--temp-dir={folder}",
        "--include-dashboard=false",
        "--disable-usage-stats",
    ]
    settings = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    with open(log_path, "w") as log:
        head = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **settings},
        )
    settings["RAY_ADDRESS"] = f"127.0.0.1:{port}"
    previous = {name: os.environ.get(name) for name in settings}
    try:
        _wait_started(head, log_path, timeout_s)
        os.environ.update(settings)
        yield settings["RAY_ADDRESS"]
    finally:
        _leave()
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        head.terminate()  # `ray start --block` ends what it started on SIGTERM
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _wait_started(head: subprocess.Popen, log_path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(log_path) as log:
            text = log.read()
        if STARTED in text:
            return
        if head.poll() is not None:
            raise RuntimeError(f"ray start --head exited with code {head.returncode}:\n{text[-3000:]}")
        time.sleep(0.25)
    raise TimeoutError(f"ray start --head did not start within {timeout_s:g} s")


def _leave() -> None:
    """Disconnect this process from the cluster (it ends the actors its engines left)."""
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()
