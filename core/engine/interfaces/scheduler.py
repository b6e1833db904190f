"""Scheduler: the policy that decides, each step, which requests run and how many tokens each
computes. Interface v3: policy only.

The core owns each request's life (:mod:`engine.core.lifecycle`): it applies the step's result
(appends tokens, advances grammars, applies stop rules), finishes requests and frees their
blocks, and runs the KV connector's request protocol. A scheduler orders the queue, admits,
chunks prefills, grants drafts their slots and preempts; it reaches the prefix cache and any
KV connector only through :class:`KVAdmission`, which the core hands it in its context.

Call order per step: :meth:`Scheduler.schedule` → the forward → the core applies the result,
calling :meth:`Scheduler.abort` for each request it finished → :meth:`Scheduler.step_done`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar

import attrs

from engine.interfaces.kv_cache import KVCacheManager
from engine.messages.request import Request
from engine.messages.step import StepPlan


@attrs.frozen
class PrefixHit:
    """What a waiting request finds before it computes anything: ``num_cached`` tokens in the
    local prefix cache (``computed_blocks``), then ``num_external`` tokens a KV connector loads —
    asynchronously (``loads_async``: the request parks until they land) or within its first step."""

    computed_blocks: list = attrs.field(factory=list, eq=False)
    num_cached: int = 0
    num_external: int = 0
    loads_async: bool = False

    @property
    def num_computed(self) -> int:
        """Tokens the request starts with: everything before its first computed token."""
        return self.num_cached + self.num_external


class KVAdmission(ABC):
    """How a waiting request gets its first blocks: the prefix cache, then the KV connector (if
    one is configured), told about every allocation as its protocol requires. A scheduler calls
    these while admitting; the core implements them (:mod:`engine.kv_transfer.admission`)."""

    @abstractmethod
    def lookup(self, request: Request) -> PrefixHit:
        """The request's prefix hit (none for one that wants prompt log-probs: those need logits
        at every prompt position). A request back from an asynchronous load (:meth:`resumed`)
        finds the tokens its blocks now hold."""

    @abstractmethod
    def allocate(self, request: Request, hit: PrefixHit, num_new_tokens: int) -> bool:
        """Blocks for the hit and the first ``num_new_tokens`` computed tokens (watermark
        applied). True: the request now counts the hit as computed and may run this step.
        False: nothing changed (the pool is short); the request stays waiting."""

    @abstractmethod
    def park(self, request: Request, hit: PrefixHit) -> bool:
        """Blocks for an asynchronous load (``hit.loads_async``), which starts: True parks the
        request (``WAITING_FOR_KV``, skipped like one waiting for its grammar) until the load
        ends and it appears in :meth:`resumed`. False: the pool is short; it stays waiting."""

    @abstractmethod
    def resumed(self) -> list[Request]:
        """Waiting requests whose asynchronous load ended, holding their blocks: admit them
        ahead of the queue, or they hold blocks a request behind them waits for."""

    @abstractmethod
    def start_over(self, request: Request) -> None:
        """A resumed request gives its blocks back and computes from the start (for one that
        cannot continue while nothing runs: nothing would ever free blocks for it)."""


@attrs.frozen
class SchedulerContext:
    """What a scheduler is constructed with. ``kv_connector`` is handed to v2 schedulers only
    (a v3 scheduler reaches the connector through ``kv_admission``)."""

    config: Any  # engine.config.EngineConfig
    kv_cache_manager: KVCacheManager
    kv_admission: KVAdmission | None = None
    max_model_len: int = 2048
    kv_connector: Any = None


@attrs.frozen
class SchedulerStats:
    """A scheduler's counters, for ``/metrics`` and the stats log."""

    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    rejected_queue_full: int = 0  # refused on arrival (max_queued_requests)
    rejected_queue_wait: int = 0  # finished unscheduled (max_queue_wait)


class Scheduler(ABC):
    """Constructed with a :class:`SchedulerContext`.

    ``serves_lora``: True for a scheduler that keeps every step within
    ``config.lora.max_loras`` distinct LoRA adapters (``Request.lora_id``; None is the base
    model), passing over a waiting request whose adapter does not fit without holding up the
    requests behind it. The engine refuses ``enable_lora`` with a scheduler that does not say so
    (the kit's ``test_lora_steps_stay_within_max_loras`` checks one that does)."""

    serves_lora: ClassVar[bool] = False

    def __init__(self, ctx: SchedulerContext):
        self.ctx = ctx

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue the request, or raise :class:`engine.interfaces.Overloaded` to refuse it
        (admission control: ``max_queued_requests``). A request whose grammar compiles is
        parked (``WAITING_FOR_GRAMMAR``) until the core sets it ``WAITING``: skip it meanwhile."""

    @abstractmethod
    def abort(self, request_ids: Iterable[str]) -> None:
        """The core finished these requests (stopped, aborted, failed, refused): drop them from
        the queues. The core frees their blocks; unknown ids are ignored."""

    @abstractmethod
    def schedule(self) -> StepPlan:
        """This step's :class:`engine.interfaces.StepPlan` (possibly empty). Requests preempted
        (their blocks freed, ``num_computed_tokens`` back to 0, status ``PREEMPTED``) go in
        ``StepPlan.preempted``; requests it refuses unscheduled (``max_queue_wait``), dropped from
        its queues, in ``StepPlan.refused``: the core finishes both kinds' drafts and the latter."""

    def reserve_lookahead(self, request: Request, num_tokens: int) -> bool:
        """Slots for ``num_tokens`` draft tokens after the request's known tokens, asked by the
        speculator before its drafter writes them; False refuses (the request gets no drafts).
        Drafts reach the plan through ``request.spec_token_ids``: schedule them with slots."""
        return self.ctx.kv_cache_manager.allocate_slots(request, 0, num_lookahead_tokens=num_tokens)

    def step_done(self, plan: StepPlan) -> None:
        """The step of ``plan`` ran and its result was applied (e.g. learn how long steps take)."""

    @property
    @abstractmethod
    def stats(self) -> SchedulerStats:
        """The scheduler's counters."""
