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
    def update_kv_transfers(self, report) -> None:
        """Apply the KV connector's :class:`engine.interfaces.KVTransferReport` of the step
        (called before :meth:`update`, also in a step that computed nothing): free the blocks
        of finished requests in ``finished_sending``, resume requests parked for an
        asynchronous load in ``finished_loading``, and make a request whose load of one of
        ``failed_blocks`` failed recompute from the last good block (this step's output of a
        request in the plan whose load failed is void)."""

    @abstractmethod
    def has_unfinished(self) -> bool:
        ...

    def has_pending_transfers(self) -> bool:
        """Whether finished requests still hold blocks a KV connector delayed freeing (the
        engine keeps stepping, without requests, until the connector reports them sent)."""
        return False

    @abstractmethod
    def running_requests(self) -> list:
        """Requests holding KV blocks now (the drafter proposes for these)."""

    @property
    @abstractmethod
    def stats(self) -> dict[str, int | float]:
        """``running``, ``waiting``, ``preemptions`` and the KV manager's counters."""
