"""How OpenMP's idle threads wait, chosen before the OpenMP runtime loads.

torch's CPU ops and the native kernels (:mod:`engine.native`) run on one OpenMP runtime, torch's
own libgomp, and so on one thread pool. Between two parallel regions libgomp's threads spin
before they sleep: ``GOMP_SPINCOUNT`` checks of a flag, 300,000 unless set (about 3 ms, by
libgomp's own estimate). A decode step is hundreds of short regions with Python in between, so
the worker threads spin through the whole step. On a quiet machine that costs nothing; on one
whose cores other processes also want, the spinning thread takes the time slices the engine's
own main thread needs, and decode collapsed to a fraction of its speed (benchmarks/RESULTS.md,
issue 24). Sleeping at once (``OMP_WAIT_POLICY=PASSIVE``) cures that but pays a futex wake-up
at every region, which costs a quiet machine half its single-stream speed. A bounded spin,
:data:`SPIN_COUNT` (~75 µs here), covers the gaps between one kernel's region and the next inside
a step and sleeps through the gaps between steps: on a quiet machine it decoded as fast as
libgomp's default, and under contention it did not collapse (benchmarks/RESULTS.md, "OpenMP's
wait policy").

libgomp reads its variables once, when it loads (when torch is imported), so
:func:`apply` runs as the ``engine`` package is imported, before anything imports torch. A user's own
``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is left alone. A process that loaded torch before the
engine keeps libgomp's default (:func:`wait_policy` says so); its child processes, an engine
core among them, still inherit the variable.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

__all__ = ["SPIN_COUNT", "WAIT_VARIABLES", "apply", "choose_wait_policy", "wait_policy"]

WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
SPIN_COUNT = 3000
_applied: str | None = None  # what apply() chose for this process


def apply() -> None:
    """:func:`choose_wait_policy` for this process's environment (the ``engine`` package's import)."""
    global _applied
    _applied = choose_wait_policy(os.environ)


def wait_policy() -> str:
    """How this process's OpenMP threads wait, in words, for the start-up log."""
    return _applied or "libgomp's default"


def choose_wait_policy(environ: MutableMapping[str, str]) -> str:
    """Set ``GOMP_SPINCOUNT`` to :data:`SPIN_COUNT` in ``environ`` unless it holds either of
    :data:`WAIT_VARIABLES`; returns how this process's OpenMP threads will wait, in words."""
    given = [f"{name}={environ[name]}" for name in WAIT_VARIABLES if name in environ]
    if given:
        return f"{', '.join(given)} (from the environment)"
    too_late = _runtime_loaded()
    environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    if too_late:
        return f"libgomp's default (torch loaded first; GOMP_SPINCOUNT={SPIN_COUNT} reaches child processes)"
    return f"GOMP_SPINCOUNT={SPIN_COUNT} (the engine's default)"


def _runtime_loaded() -> bool:
    """Whether libgomp is already in this process, too late for its variables to take effect."""
    try:
        with open("/proc/self/maps") as maps:
            return any("libgomp" in line for line in maps)
    except OSError:
        return "torch" in sys.modules
