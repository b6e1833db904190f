"""Scheduler: decides, each step, which requests run and how many tokens each computes."""

from abc import ABC, abstractmethod
from typing import Any


class Scheduler(ABC):
    """Constructed with a :class:`engine.interfaces.SchedulerContext` (config, KV cache
    manager, optional KV connector)."""

    def __init__(self, ctx: Any):
        self.ctx = ctx

    @abstractmethod
    def add_request(self, request) -> None:
        """Queue the request, or raise :class:`engine.interfaces.Overloaded` to refuse it
        (admission control: ``max_queued_requests``)."""

    @abstractmethod
    def abort(self, request_ids) -> None:
        """Finish these requests with ``finish_reason="abort"`` and free their blocks."""

    @abstractmethod
    def schedule(self):
        """Return an :class:`engine.interfaces.StepPlan` (possibly empty). Requests it
        finished unscheduled for overload (``max_queue_wait``) go in ``StepPlan.refused``."""

    @abstractmethod
    def update(self, plan, result) -> list:
        """Apply the runner's :class:`engine.interfaces.StepResult`; return the
        :class:`engine.interfaces.EngineOutput` of every request that made progress. A
        request in ``result.pooled`` is done: it finishes ("stop", its blocks freed) with
        ``EngineOutput.pooled`` holding its vector."""

    @abstractmethod
    def free_finished_transfers(self, request_ids) -> None:
        """Free the blocks of finished requests whose KV connector has finished sending."""

    @abstractmethod
    def has_unfinished(self) -> bool:
        ...

    @abstractmethod
    def running_requests(self) -> list:
        """Requests holding KV blocks now (the drafter proposes for these)."""

    @property
    @abstractmethod
    def stats(self) -> dict[str, int | float]:
        """``running``, ``waiting``, ``preemptions`` and the KV manager's counters."""
