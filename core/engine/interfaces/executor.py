"""Executor: where the model runner's steps run — in this process (``uni``), or on N
tensor-parallel ranks (``mp``: this process is rank 0, the driver, and spawns the others).

The engine core owns the one scheduler. It builds rank 0's model inside the executor's
:attr:`Executor.tensor_parallel` group, allocates rank 0's KV cache, hands the executor its
:class:`engine.runner.model_runner.ModelRunner` with :meth:`Executor.start`, and then calls
:meth:`Executor.execute` once per step. A multi-rank executor broadcasts that step's
:class:`engine.runner.model_runner.StepInput` (one picklable object: token ids, positions,
the attention layouts, the rows to score) to every rank before rank 0 runs it; the other
ranks run the same forward, joining its collectives, and return nothing: outputs come from
rank 0 only (it samples). Drafts come from rank 0 too, in the next step's input; a drafter
that calls the target's sharded layers runs on every rank (:meth:`Executor.drafter_call`).
Workers load plugins with the engine's allow-list
(:func:`engine.plugins.load_plugins`, idempotent) and report a failure to load or to step to
the driver.

Faults: anything that leaves the ranks out of step (a collective that fails or times out, a
worker that exits, rank 0 failing mid-forward) raises :class:`ExecutorFailure`, which the
engine core never retries: the engine fails cleanly instead of hanging.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import attrs

from engine.distributed import TensorParallel


@attrs.frozen
class ExecutorContext:
    """What an executor is built from: the resolved :class:`engine.EngineConfig` (model path,
    dtype and max_model_len filled in) and the selected, configured platform."""

    config: Any
    platform: Any


class Executor(ABC):
    name: ClassVar[str]

    def __init__(self, ctx: ExecutorContext):
        self.ctx = ctx

    @classmethod
    def supports(cls, config) -> list[str]:
        """Reasons this executor cannot run ``config``; empty when it can."""
        return []

    @property
    @abstractmethod
    def tensor_parallel(self) -> TensorParallel:
        """Rank 0's group: the engine builds rank 0's model inside it."""

    @abstractmethod
    def start(self, runner, kv_groups) -> None:
        """Rank 0's runner is built; ``kv_groups`` (:class:`engine.interfaces.KVCacheGroup`,
        block counts decided by rank 0) size every other rank's KV cache. Returns when every
        rank is ready to step; raises :class:`ExecutorFailure` naming a rank that failed."""

    @abstractmethod
    def execute(self, plan, group_tables, bitmask=None, kv_meta=None):
        """One step on every rank; rank 0's :class:`engine.interfaces.StepResult`. ``kv_meta``:
        the KV connector's metadata for the step (None: no connector), for rank 0's runner."""

    def drafter_call(self, drafter, name: str, *args):
        """(v2) ``drafter.<name>(*args)`` on every rank, each on its own instance (a drafter
        that ``drafts_on_every_rank``); rank 0's result. One rank: the call itself."""
        return getattr(drafter, name)(*args)

    def share(self, value):
        """(v2) ``value`` to every rank, inside :meth:`drafter_call` (``DrafterContext.share``
        on rank 0); returns it. One rank: the value itself."""
        return value

    def sleep_mode_call(self, sleep_mode, name: str, *args) -> list:
        """(v3) ``sleep_mode.<name>(*args)`` on every rank, each on its own
        :class:`engine.core.sleep.SleepMode` (sleep, wake, a weight update's steps), all at once
        (a weight update's collectives with a trainer span the ranks); every rank's result, rank
        order. Raises ``ValueError`` with what a rank raised (the ranks stay in step), or
        :class:`ExecutorFailure`. One rank: the call itself (a multi-rank executor that keeps
        this default is refused sleep mode and weight updates)."""
        return [getattr(sleep_mode, name)(*args)]

    def check_health(self) -> None:
        """Raise :class:`ExecutorFailure` if a rank is gone (cheap: called between steps)."""

    def weight_bytes_read(self) -> list[int | None]:
        """Checkpoint bytes each rank read for its weights (None: its loader does not count)."""
        return []

    def shutdown(self) -> None:
        """Stop every rank this executor started (idempotent). The engine also calls it when
        its start fails once the executor exists, which may be before :meth:`start`."""
