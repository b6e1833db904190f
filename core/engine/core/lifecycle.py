"""Each request's life in the core, around a policy-only scheduler (interface v3).

The scheduler decides who runs; this module applies what ran: it counts computed tokens,
appends the verified tokens, advances the request's grammar, applies the token-level stop rules
(EOS, stop token ids, a terminated grammar, ``max_tokens``, the model's length), finishes
requests and frees their blocks (through :class:`~engine.kv_transfer.admission.RequestKV`, which
runs the KV connector's request protocol), and builds each step's
:class:`~engine.interfaces.EngineOutput`. Stop strings are the front end's (they need text).
"""

from __future__ import annotations

import logging

import attrs

from engine.core.scheduler_v2 import SchedulerV2Lifecycle
from engine.interfaces import (
    INTERFACE_VERSIONS,
    EngineOutput,
    KVTransferReport,
    Request,
    RequestStatus,
    ScheduledRequest,
    Scheduler,
    SchedulerContext,
    StepPlan,
    StepResult,
)
from engine.kv_transfer.admission import RequestKV

logger = logging.getLogger(__name__)


class RequestLifecycle:
    def __init__(self, scheduler: Scheduler, kv: RequestKV, max_model_len: int):
        self.scheduler = scheduler
        self.kv = kv
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}  # every unfinished request

    def add(self, request: Request) -> None:
        """Queue the request (the scheduler may refuse it: ``Overloaded``)."""
        self.scheduler.add_request(request)
        self.requests[request.request_id] = request

    def schedule(self) -> StepPlan:
        """The scheduler's plan; preempted requests lose their drafts, refused ones finish."""
        plan = self.scheduler.schedule()
        for rid in plan.preempted:
            request = self.requests[rid]
            request.spec_token_ids, request.spec_probs = [], None
        for rid in plan.refused:
            self.finish(self.requests[rid], "error")
        return plan

    def apply(self, plan: StepPlan, result: StepResult) -> list[EngineOutput]:
        """The step's result applied to every scheduled request; the outputs of those that
        made progress."""
        outputs = [out for item in plan.scheduled if (out := self._apply(item, result)) is not None]
        self.scheduler.step_done(plan)
        return outputs

    def _apply(self, item: ScheduledRequest, result: StepResult) -> EngineOutput | None:
        request = item.request
        rid = request.request_id
        good = self.kv.settle(rid)
        if request.is_finished:  # aborted while the step ran
            return None
        if good is not None:  # its load failed: what the step computed after the good blocks is void
            request.num_computed_tokens = good
            request.num_cached_tokens = min(request.num_cached_tokens, good)
            return None
        request.num_computed_tokens += item.num_new_tokens
        if rid in result.pooled:
            self.finish(request, "stop")
            return EngineOutput(rid, [], finish_reason="stop", pooled=result.pooled[rid])
        prompt_logprobs = result.prompt_logprobs.get(rid)
        if prompt_logprobs:
            request.num_prompt_logprobs += len(prompt_logprobs)
        tokens = result.sampled.get(rid)
        if tokens is None:
            return EngineOutput(rid, [], new_prompt_logprobs=prompt_logprobs) if prompt_logprobs else None
        request.num_computed_tokens += len(tokens) - 1  # accepted drafts were computed
        request.spec_token_ids, request.spec_probs = [], None
        accepted, reason, error = self._append(request, tokens)
        logprobs = result.logprobs.get(rid)
        handed_on = self.finish(request, reason) if reason else None
        return EngineOutput(
            rid,
            accepted,
            logprobs[: len(accepted)] if logprobs else None,
            prompt_logprobs,
            finish_reason=reason,
            stop_reason=request.stop_reason,
            error=error,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens,
            kv_transfer_params=handed_on,
        )

    def _append(self, request: Request, tokens: list[int]) -> tuple[list[int], str | None, str | None]:
        """Append tokens until one stops the request: (appended, finish reason, error)."""
        accepted: list[int] = []
        for token in tokens:
            if request.grammar is not None and not request.grammar.accept_tokens([token]):
                return accepted, "error", _grammar_desync(request, token)
            request.append_output(token)
            accepted.append(token)
            reason = self._stop_reason(request, token)
            if reason:
                return accepted, reason, None
        return accepted, None, None

    def _stop_reason(self, request: Request, token: int) -> str | None:
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if token == request.eos_token_id and not params.ignore_eos:
                return "stop"
            if token in params.stop_token_ids:
                request.stop_reason = token
                return "stop"
            if request.grammar is not None and request.grammar.is_terminated():
                return "stop"
        if (
            params.max_tokens is not None and num_output >= params.max_tokens
        ) or request.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, request: Request, reason: str) -> dict | None:
        """Finish the request: out of the scheduler's queues, its blocks freed (now, or when the
        KV connector is done with them). Returns what the connector hands on with its last
        output (``kv_transfer_params``), or None."""
        self.scheduler.abort([request.request_id])
        request.finish_reason = reason
        handed_on = self.kv.release(request)
        request.status = RequestStatus.FINISHED
        del self.requests[request.request_id]
        return handed_on

    def abort(self, request_ids, reason: str = "abort") -> None:
        """Finish these requests (unknown or finished ones are ignored)."""
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is not None:
                self.finish(request, reason)

    def on_kv_report(self, report: KVTransferReport) -> None:
        """The KV connector's report of the step (before :meth:`apply`, also in a step that
        computed nothing)."""
        self.kv.on_report(report)

    def running(self, plan: StepPlan) -> list[Request]:
        """The plan's requests still running after it was applied (the drafter proposes for these)."""
        return [item.request for item in plan.scheduled if item.request.status is RequestStatus.RUNNING]

    def reserve_lookahead(self, request: Request, num_tokens: int) -> bool:
        return self.scheduler.reserve_lookahead(request, num_tokens)

    def with_burst(self, plan: StepPlan, steps: int) -> StepPlan:
        """``plan`` allowed up to ``steps`` decode steps in a row (``StepPlan.decode_burst``),
        where every unfinished request is in it decoding one token greedily (a waiting one
        would wait the burst out; a sampled one could not run it, and its slots would be held
        for nothing) and the scheduler gives each slots for the burst's tokens, cut to what
        ``max_tokens`` and the model's length leave; else ``plan`` as it is. The runner runs the
        burst only where its rows' tokens need nothing but the model (no penalties, masks or
        logprobs either), and a request's stop among them discards the rest, as a rejected
        draft's."""
        if steps < 2 or len(plan.scheduled) != len(self.requests):
            return plan
        burst = steps
        for item in plan.scheduled:
            request = item.request
            if (
                item.num_new_tokens != 1
                or item.spec_token_ids
                or request.num_computed_tokens != request.num_tokens - 1
                or not request.sampling_params.greedy
            ):
                return plan
            left = (request.sampling_params.max_tokens or self.max_model_len) - len(request.output_token_ids)
            burst = min(burst, left, self.max_model_len - request.num_tokens)
        if burst < 2 or not all(self.reserve_lookahead(item.request, burst) for item in plan.scheduled):
            return plan
        return attrs.evolve(plan, decode_burst=burst)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_pending_transfers(self) -> bool:
        return self.kv.has_pending_transfers()

    def stats(self) -> dict[str, int | float]:
        kv = self.kv.kv
        return {**attrs.asdict(self.scheduler.stats), "kv_cache_usage": kv.usage, **kv.stats, **self.kv.stats}


def _grammar_desync(request: Request, token: int) -> str:
    """The error of a request whose grammar refused a token its own mask allowed: the backend's
    state and the sequence no longer agree, so nothing after it could be trusted."""
    logger.error(
        "request %s: the grammar refused token %d that its bitmask allowed; finishing it with an error",
        request.request_id,
        token,
    )
    return f"grammar backend refused token {token} that its own bitmask allowed (internal error)"


RequestPath = RequestLifecycle | SchedulerV2Lifecycle  # what the engine loop drives


def request_path(registry, config, kv_cache_manager, connector, max_model_len: int) -> RequestPath:
    """The configured scheduler and the request path around it: a :class:`RequestLifecycle`, or
    for a scheduler built for interface v2 the adapter that lets it apply results itself."""
    registration = registry.registration("schedulers", config.scheduler.scheduler)
    cls = registration.load()
    if config.lora.enable_lora and not (
        registration.api >= INTERFACE_VERSIONS["schedulers"] and cls.serves_lora
    ):
        raise ValueError(
            f"enable_lora: scheduler {config.scheduler.scheduler!r} does not keep a step within "
            "max_loras adapters (Scheduler.serves_lora)"
        )
    if registration.api < INTERFACE_VERSIONS["schedulers"]:
        scheduler = cls(
            SchedulerContext(config, kv_cache_manager, None, max_model_len, kv_connector=connector)
        )
        return SchedulerV2Lifecycle(scheduler, kv_cache_manager)
    kv = RequestKV(kv_cache_manager, connector, config.cache.block_size)
    return RequestLifecycle(
        cls(SchedulerContext(config, kv_cache_manager, kv, max_model_len)), kv, max_model_len
    )
