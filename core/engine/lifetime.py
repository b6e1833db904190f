"""A child process that must not outlive its parent: the engine core (its parent is the API
process) and tensor-parallel workers (theirs is the driver)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1  # linux/prctl.h
WATCHDOG_INTERVAL_S = 0.5


def exit_with_parent(parent_pid: int) -> bool:
    """Have the kernel SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``:
    works even mid-step; strictly it fires when the parent's thread that spawned us ends);
    False if the parent is already gone."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    return os.getppid() == parent_pid


def watch_parent(parent_pid: int) -> None:
    """A daemon thread that exits the process once its parent is gone (for systems without
    ``PR_SET_PDEATHSIG``)."""
    def watch():
        while os.getppid() == parent_pid:
            threading.Event().wait(WATCHDOG_INTERVAL_S)
        os._exit(1)

    threading.Thread(target=watch, name="engine-parent-watchdog", daemon=True).start()
