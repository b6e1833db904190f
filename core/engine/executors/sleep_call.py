"""What the driver broadcasts for a sleep-mode call (sleep, wake, the steps of a weight update:
:class:`engine.core.sleep.SleepMode`): the method each rank runs on its own ``SleepMode``, and
the :class:`Outcome` each rank then reports to all (a gather on the control group), so that
rank 0 answers for every rank. (Not in :mod:`engine.executors.worker`: the ``mp`` worker runs
that module as ``__main__``, whose classes are not the ones unpickled.)"""

from __future__ import annotations

import attrs

from engine.interfaces import ExecutorFailure


@attrs.frozen
class SleepModeCall:
    """Run ``sleep_mode.<name>(*args)`` (rank 0 runs the same call on its own)."""

    name: str
    args: tuple


@attrs.frozen
class Outcome:
    """One rank's result of a call, or what it raised (``fatal``: an :class:`ExecutorFailure`,
    the ranks' collectives are out of step)."""

    value: object = None
    error: str | None = None
    fatal: bool = False


def run(sleep_mode, call: SleepModeCall) -> Outcome:
    try:
        return Outcome(getattr(sleep_mode, call.name)(*call.args))
    except ExecutorFailure as exc:
        return Outcome(error=str(exc), fatal=True)
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which raises it for every rank
        return Outcome(error=str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}")


def results(outcomes: list[Outcome]) -> list:
    """Every rank's value, rank order; raises what failed — once when every rank says the same
    (they usually do: each checked its share of the same weights), else naming each rank."""
    failed = [(rank, o) for rank, o in enumerate(outcomes) if o.error is not None]
    if not failed:
        return [o.value for o in outcomes]
    errors = {o.error for _, o in failed}
    message = (
        errors.pop()
        if len(errors) == 1 and len(failed) == len(outcomes)
        else "; ".join(f"rank {rank}: {o.error}" for rank, o in failed)
    )
    if any(o.fatal for _, o in failed):
        raise ExecutorFailure(message)
    raise ValueError(message)
