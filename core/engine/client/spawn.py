"""Starting the engine-core process (``python -m engine.client.core_process``), and starting
it early.

``engine serve`` spends its first seconds importing torch and its plugins and parsing its
command line before it knows the core's arguments, and a new core spends its first seconds
importing the same modules. :func:`start_early` starts the core at once, its arguments to follow
on its standard input, so that the two processes import side by side; :func:`spawn_core` then
hands that core its arguments, or starts one with them. Only standard-library imports here: the
``engine`` command calls :func:`start_early` before it imports torch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}  # the core ignores these: its front end decides
ARGUMENTS_ON_STDIN = "--arguments-on-stdin"  # a core started early: one JSON list of its arguments

_early: subprocess.Popen | None = None


def start_early() -> subprocess.Popen:
    """Start a core now, to be handed its arguments by the next :func:`spawn_core`. Until then
    it imports; a front end that exits without spawning closes the pipe, and the core exits."""
    global _early
    _early = _popen([ARGUMENTS_ON_STDIN], stdin=subprocess.PIPE)
    return _early


def spawn_core(arguments: list[str], cpus: set[int] | None = None) -> subprocess.Popen:
    """A core running with ``arguments``: the one :func:`start_early` started if there is one
    and ``cpus`` is None, else a new one pinned to ``cpus`` as it starts (long before it
    imports torch and sizes its thread pool from them; the early core has imported it)."""
    early = _take_early()
    if early is not None and cpus is None and _hand(early, arguments):
        return early
    if early is not None:
        _discard(early)
    process = _popen(arguments)
    if cpus is not None:
        os.sched_setaffinity(process.pid, cpus)
    return process


def read_arguments() -> list[str] | None:
    """In a core started early: its arguments from standard input (None: the front end exited
    or spawned no core, so this one is not needed)."""
    line = sys.stdin.readline()
    return json.loads(line) if line else None


def _popen(arguments: list[str], stdin=None) -> subprocess.Popen:
    """``python -m engine.client.core_process ARGUMENTS`` with SIGINT/SIGTERM blocked: the
    blocked mask survives exec, and the core ignores both before it unblocks them, so a signal
    sent to the whole process group (Ctrl-C, systemd, a container stop) cannot kill it even
    while it imports; only its front end tells it to stop."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        return subprocess.Popen([sys.executable, "-m", "engine.client.core_process", *arguments], stdin=stdin)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _take_early() -> subprocess.Popen | None:
    global _early
    early, _early = _early, None
    return early


def _hand(process: subprocess.Popen, arguments: list[str]) -> bool:
    """Send a waiting core its arguments; False if it is gone."""
    assert process.stdin is not None
    try:
        process.stdin.write(json.dumps(arguments).encode() + b"\n")
        process.stdin.close()
    except OSError:  # it died while importing
        return False
    return process.poll() is None


def _discard(process: subprocess.Popen) -> None:
    """End a core started early that will not be used (closing its pipe would too, once it
    has imported; killing it frees the CPU at once)."""
    process.kill()
    process.wait()
