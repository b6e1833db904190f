"""A local Ray cluster for the tests: ``ray start --head --block`` on free ports in a short
temporary folder of its own; ``RAY_ADDRESS`` points this process and the servers it starts at
it. Stopping it ends the processes that ``ray start`` started (never ``ray stop``, which ends
every Ray process on the machine)."""

from __future__ import annotations

import contextlib
import os
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
    command = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", "--block",
               f"--port={port}", f"--num-cpus={num_cpus}", "--num-gpus=0", f"--temp-dir={folder}",
               "--include-dashboard=false", "--disable-usage-stats"]
    with open(log_path, "w") as log:
        head = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    previous = os.environ.get("RAY_ADDRESS")
    try:
        _wait_started(head, log_path, timeout_s)
        os.environ["RAY_ADDRESS"] = f"127.0.0.1:{port}"
        yield os.environ["RAY_ADDRESS"]
    finally:
        _leave()
        if previous is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = previous
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
