"""Waiting for a launched server to serve, shared by the benchmarks that start one."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import httpx


def wait_healthy(
    url: str,
    process: subprocess.Popen,
    timeout: float = 600,
    poll: float = 0.5,
    log_tail: Callable[[], str] | None = None,
) -> None:
    """Return once ``url`` (e.g. ``.../health``) answers 200; RuntimeError if ``process`` exits
    first or ``timeout`` seconds pass, with ``log_tail()`` (the server's last output) appended.
    One client polls: a bare ``httpx.get`` builds a TLS context each time (~30 ms of CPU), which
    at a 50 ms poll took over half a core from the server starting beside it on a 2-core machine."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                _fail(f"the server exited ({process.returncode}) before it served", log_tail)
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(poll)
    _fail(f"the server did not serve within {timeout:g} s", log_tail)


def _fail(reason: str, log_tail: Callable[[], str] | None) -> None:
    raise RuntimeError(f"{reason}; its last output:\n{log_tail()}" if log_tail else reason)
