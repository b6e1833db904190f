"""Messages between the scheduler, the runner, the engine core and its front end for one step."""

from __future__ import annotations

from typing import Any

import attrs

from engine.messages.request import Request

OVERLOADED = "overloaded"  # EngineOutput.error_code of a request refused by admission control


class Overloaded(Exception):
    """Raised by ``Scheduler.add_request`` to refuse a request (its queue is full); the
    request is not queued. The server answers 503 with ``Retry-After``."""

    code = OVERLOADED


class Asleep(Overloaded):
    """Raised by the engine core for a request that comes while it sleeps (sleep mode): refused
    as an overloaded one is, so that a client retries after the wake-up."""


@attrs.frozen
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # known tokens computed this step, from request.num_computed_tokens
    spec_token_ids: tuple[int, ...] = ()  # drafts verified this step

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the known tokens, so a token is sampled
        (never for a pooling request: it pools instead)."""
        r = self.request
        return r.pooling_params is None and r.num_computed_tokens + self.num_new_tokens >= r.num_tokens


@attrs.frozen
class StepPlan:
    scheduled: tuple[ScheduledRequest, ...]
    preempted: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()  # waiting requests finished unscheduled: they queued past max_queue_wait
    # the most greedy decode steps the runner may run in a row for this plan (the core sets it:
    # ``num_scheduler_steps``; every request has slots for them); it may run fewer
    decode_burst: int = 1

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens + len(s.spec_token_ids) for s in self.scheduled)


@attrs.frozen
class TokenLogprobs:
    """Logprobs of one position: the chosen token first, then the top-n (compact, no text)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    ranks: tuple[int, ...]


@attrs.frozen
class StepResult:
    sampled: dict[str, list[int]]  # request id -> accepted drafts + one new token, or a burst's tokens
    logprobs: dict[str, list[TokenLogprobs]] = attrs.Factory(dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = attrs.Factory(dict)
    hidden_states: dict[str, object] = attrs.Factory(dict)  # request id -> [valid rows, hidden], if kept
    pooled: dict[str, object] = attrs.Factory(
        dict
    )  # pooling request id -> its vector [dim] float32 on the CPU


@attrs.frozen
class RequestTiming:
    """Where a request's wait went, in seconds, measured in the engine core as vLLM
    defines its phases: ``queue`` from being added to the core until first scheduled,
    ``prefill`` from then until its first token (every prefill chunk, and any preemption
    before the first token). Sent once, with the request's first token; decode time is
    measured where the tokens arrive."""

    queue: float
    prefill: float


@attrs.frozen
class EngineOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    error_code: str | None = None  # with finish_reason "error": OVERLOADED, or None
    num_draft_tokens: int = 0  # speculative drafts verified for this request so far, and accepted
    num_accepted_tokens: int = 0
    timing: RequestTiming | None = None  # on the request's first output that carries tokens
    pooled: Any = None  # a pooling request's vector (a float32 CPU tensor), with its finish
    kv_transfer_params: dict | None = None  # with its finish: what the KV connector hands on (P/D)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
