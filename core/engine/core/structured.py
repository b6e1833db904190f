"""Structured outputs in the core: grammars compile on a worker thread while their request
waits parked (it does not block the queue); each step one bitmask row per sampling row. A
request's grammar is touched here and in the request lifecycle only (which advances it by the
tokens it appends, :mod:`engine.core.lifecycle`).

The compile thread runs at a lower CPU priority (nice 5: about a quarter of a normal
thread's share; threads a backend starts from it inherit that on Linux), so a grammar
that takes seconds to compile slows the step loop little, yet still progresses while the
engine is busy (at nice 19 it would get ~1.5% and could wait minutes).

With ``structured_outputs_backend="auto"`` (vLLM's fallback) it holds every installed backend,
in the registry's order of preference, and a request's grammar is compiled by the first that
supports its spec and compiles it; each refusal is logged and, when none compiles it, the
request fails with every backend's reason. A backend registered for an older grammar interface
is never handed a kind added after it (``KIND_SINCE``). With the reasoning parser's markers,
every grammar is wrapped in a :class:`engine.core.reasoning_gate.ReasoningGate`."""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.core.reasoning_gate import ReasoningGate
from engine.interfaces.grammar import KIND_SINCE, Grammar, GrammarBackend, GrammarContext, GrammarSpec
from engine.interfaces.reasoning_parser import ReasoningMarkers
from engine.messages.request import Request, RequestStatus
from engine.messages.step import EngineOutput, StepPlan

COMPILE_NICENESS = 5
logger = logging.getLogger(__name__)


class StructuredOutputs:
    def __init__(
        self,
        backends: dict[str, type[GrammarBackend]],
        ctx: GrammarContext,
        apis: dict[str, int] | None = None,
        reasoning: ReasoningMarkers | None = None,
    ):
        """``backends``: name -> class, in the order to try them (one, unless ``auto``). Under
        ``auto`` a backend that cannot be built for this model (ValueError: llguidance reads
        fast tokenizers only) is left out, with a warning; one alone raises. ``apis``: the
        interface version each registered for (default: the current one). ``reasoning``: the
        markers of the reasoning the grammars wait out (None: grammars span the output)."""
        self.apis = apis or {}
        self.reasoning = reasoning
        self.eos = getattr(ctx.tokenizer, "eos_token_id", None)
        self.backends = {}
        for name, cls in backends.items():
            try:
                self.backends[name] = cls(ctx)
            except ValueError as error:
                if len(backends) == 1:
                    raise
                logger.warning("grammar backend %s left out of auto: %s", name, error)
        if not self.backends:
            raise ValueError("no grammar backend can be built for this model")
        self.vocab_size = ctx.vocab_size
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="grammar-compile", initializer=_background_priority
        )
        self._pending: dict[str, tuple[Request, Future]] = {}

    def submit(self, request: Request) -> None:
        spec = request.sampling_params.structured_outputs
        refusals = {name: self._refusals(name, backend, spec) for name, backend in self.backends.items()}
        able = {name: b for name, b in self.backends.items() if not refusals[name]}
        future: Future = Future()
        if able:
            future = self._pool.submit(self._compile, request.request_id, spec, able)
        else:
            future.set_exception(ValueError("; ".join(r for reasons in refusals.values() for r in reasons)))
        request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self._pending[request.request_id] = (request, future)

    def _refusals(self, name: str, backend: GrammarBackend, spec: GrammarSpec) -> list[str]:
        since = KIND_SINCE.get(spec.kind)
        api = self.apis.get(name)
        if since is not None and api is not None and api < since:
            return [f"{name} targets grammar interface v{api}, older than {spec.kind!r} (v{since})"]
        return backend.supports(spec)

    def _compile(self, request_id: str, spec: GrammarSpec, backends: dict[str, GrammarBackend]) -> Grammar:
        """The grammar of the first of ``backends`` that compiles ``spec`` (on the compile
        thread), behind the reasoning gate when there is one."""
        grammar = self._first_compiled(request_id, spec, backends)
        if self.reasoning is not None and self.eos is not None:
            return ReasoningGate(grammar, self.reasoning, self.eos)
        return grammar

    def _first_compiled(
        self, request_id: str, spec: GrammarSpec, backends: dict[str, GrammarBackend]
    ) -> Grammar:
        errors: list[str] = []
        for name, backend in backends.items():
            try:
                grammar = backend.compile(spec)
            except ValueError as error:
                if len(backends) == 1:
                    raise
                errors.append(f"{name}: {error}")
                logger.info(
                    "request %s: grammar backend %s cannot compile its %s: %s",
                    request_id,
                    name,
                    spec.kind,
                    error,
                )
                continue
            if errors:
                logger.info(
                    "request %s: its %s grammar compiled by %s (fallback)", request_id, spec.kind, name
                )
            return grammar
        raise ValueError("no grammar backend compiles it: " + "; ".join(errors))

    def poll(self, lifecycle) -> list[EngineOutput]:
        """Release compiled requests to the queue; fail those whose grammar is invalid."""
        failed = []
        for rid, (request, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[rid]
            if request.is_finished:
                continue
            error = future.exception()
            if error is None:
                request.grammar = future.result()
                request.status = RequestStatus.WAITING
                continue
            lifecycle.abort([rid], "error")
            failed.append(EngineOutput(rid, [], finish_reason="error", error=f"invalid grammar: {error}"))
        return failed

    def bitmask(self, plan: StepPlan) -> torch.Tensor | None:
        """One row per sampling row. A request verifying k drafts has k + 1 rows: row j is
        the grammar's mask after the first j drafts (the grammar is rolled back afterwards;
        the speculator only keeps drafts the grammar accepts)."""
        items = [item for item in plan.scheduled if item.samples]
        if not any(item.request.grammar is not None for item in items):
            return None
        rows = sum(len(item.spec_token_ids) + 1 for item in items)
        mask = torch.full((rows, -(-self.vocab_size // 32)), -1, dtype=torch.int32)
        row = 0
        for item in items:
            if item.request.grammar is not None:
                _fill_rows(item.request.grammar, item.spec_token_ids, mask, row)
            row += len(item.spec_token_ids) + 1
        return mask

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _fill_rows(grammar, drafts: tuple[int, ...], mask: torch.Tensor, row: int) -> None:
    """Rows ``row..row + len(drafts)``: the grammar's mask before each draft and after the last.
    Rows after a draft that ends the grammar (its EOS) stay all-allowed: the request ends there,
    and a terminated grammar is never asked for a mask."""
    accepted = 0
    for j in range(len(drafts) + 1):
        if grammar.is_terminated():
            break
        grammar.fill_bitmask(mask, row + j)
        if j < len(drafts):
            if not grammar.accept_tokens([drafts[j]]):
                raise RuntimeError("a draft the grammar refuses reached verification")
            accepted += 1
    if accepted:
        grammar.rollback(accepted)


def grammar_prefix(request: Request, tokens: list[int]) -> list[int]:
    """The longest prefix of ``tokens`` (drafts) the request's grammar accepts; the grammar is
    left where it was."""
    grammar = request.grammar
    if grammar is None:
        return tokens
    valid = 0
    for token in tokens:
        if not grammar.accept_tokens([token]):
            break
        valid += 1
    if valid:
        grammar.rollback(valid)
    return tokens[:valid]


def _background_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
    except (OSError, AttributeError):  # not permitted or not Linux: run at normal priority
        pass
