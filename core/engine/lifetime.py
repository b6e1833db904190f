"""A child process that must not outlive its parent: the engine core (its parent is the API
process) and tensor-parallel workers (theirs is the driver)."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from typing import NoReturn

PR_SET_PDEATHSIG = 1  # linux/prctl.h
WATCHDOG_INTERVAL_S = 0.5


def exit_with_parent(parent_pid: int) -> bool:
    """Have the kernel SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``:
    works even mid-step; strictly it fires when the parent's thread that spawned us ends);
    False if the parent is already gone."""
    if sys.platform.startswith("linux"):
        _prctl()(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL))
    return os.getppid() == parent_pid


def _prctl():
    """libc's ``int prctl(int option, ...)`` typed: the option an int, the variadic rest passed
    as unsigned long by the caller, the result checked (ctypes would guess all three)."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes, prctl.restype = [ctypes.c_int], ctypes.c_int
    prctl.errcheck = _check_errno
    return prctl


def _check_errno(result, function, args):
    if result == -1:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{function.__name__}{args}: {os.strerror(errno)}")
    return result


def watch_parent(parent_pid: int) -> None:
    """A daemon thread that exits the process once its parent is gone (for systems without
    ``PR_SET_PDEATHSIG``)."""

    def watch():
        while os.getppid() == parent_pid:
            threading.Event().wait(WATCHDOG_INTERVAL_S)
        os._exit(1)

    threading.Thread(target=watch, name="engine-parent-watchdog", daemon=True).start()


def exit_now(code: int) -> NoReturn:
    """Exit without the interpreter's teardown (seconds with torch loaded, on a busy machine),
    for a process whose own resources are already closed: a supervisor (or a test) sees it gone
    at once."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
