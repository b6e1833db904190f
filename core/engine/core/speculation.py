"""Speculative decoding in the core: after every step, ask the drafter for the next drafts of
each decoding request (their KV slots granted by the scheduler first), cut drafts at the first
token the request's grammar refuses (:func:`engine.core.structured.grammar_prefix`), and count
what verification accepts. Under tensor parallelism the drafter runs here, on rank 0, unless
it drafts on every rank: then each call goes through the executor to every rank's drafter."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.core.structured import grammar_prefix
from engine.interfaces import Draft, DraftRequest, Request, StepPlan, StepResult

ACCEPTED_AT = "spec_accepted_pos:"  # stats key prefix: accepted drafts at a draft position (0 = first)


class Speculator:
    def __init__(
        self,
        drafter,
        num_spec_tokens: int,
        kv_cache_manager,
        max_model_len: int,
        call: Callable[..., Any] | None = None,
    ):
        """``kv_cache_manager``: read for the block tables the drafter writes into. ``call(name,
        *args)`` runs ``drafter.<name>(*args)`` (:meth:`engine.interfaces.Executor.drafter_call`
        for a drafter that drafts on every rank); None: here."""
        self.drafter = drafter
        self.call = call if call is not None else self._here
        self.k = num_spec_tokens
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.counts = {"spec_drafts": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0}
        self.accepted_per_pos = [0] * num_spec_tokens  # drafts accepted at each draft position

    def record(self, plan: StepPlan, result: StepResult) -> None:
        for item in plan.scheduled:
            tokens = result.sampled.get(item.request.request_id)
            if item.spec_token_ids and tokens is not None:
                accepted = len(tokens) - 1
                item.request.num_draft_tokens += len(item.spec_token_ids)
                item.request.num_accepted_tokens += accepted
                self.counts["spec_drafts"] += 1
                self.counts["spec_draft_tokens"] += len(item.spec_token_ids)
                self.counts["spec_accepted_tokens"] += accepted
                for pos in range(accepted):
                    self.accepted_per_pos[pos] += 1

    def propose(
        self, running: list[Request], result: StepResult, reserve: Callable[[Request, int], bool]
    ) -> None:
        """Drafts for each request of ``running`` that decodes; ``reserve(request, n)`` asks the
        scheduler for slots for ``n`` drafts (refused: no drafts for it)."""
        eligible = []
        for request in running:
            if request.num_computed_tokens != request.num_tokens - 1:  # still prefilling
                continue
            params = request.sampling_params
            room = min(
                self.k,
                self.max_model_len - request.num_tokens - 1,
                (params.max_tokens or self.max_model_len) - len(request.output_token_ids) - 1,
            )
            if room > 0 and reserve(request, room):
                eligible.append((request, room))
        if not eligible:
            return
        hidden = result.hidden_states
        drafts = self.call(
            "propose",
            [
                DraftRequest(
                    r.request_id,
                    r.all_token_ids,
                    room,
                    self.kv.block_ids(r),
                    r.sampling_params,
                    hidden.get(r.request_id),
                )
                for r, room in eligible
            ],
        )
        for (request, room), draft in zip(eligible, drafts):
            tokens, probs = self._allowed(request, draft, room)
            request.spec_token_ids, request.spec_probs = tokens, probs

    @staticmethod
    def _allowed(request: Request, draft: Draft, room: int):
        tokens = grammar_prefix(request, list(draft.token_ids[:room]))
        probs = None if draft.probs is None or not tokens else draft.probs[: len(tokens)]
        return tokens, probs

    def finished(self, request_ids) -> None:
        if request_ids:
            self.call("finished", list(request_ids))

    def _here(self, name: str, *args):
        return getattr(self.drafter, name)(*args)

    def stats(self) -> dict[str, float]:
        c = self.counts
        drafts, proposed, accepted = c["spec_drafts"], c["spec_draft_tokens"], c["spec_accepted_tokens"]
        per_pos = {f"{ACCEPTED_AT}{pos}": n for pos, n in enumerate(self.accepted_per_pos)}
        return {
            **c,
            **per_pos,
            "spec_acceptance_rate": accepted / proposed if proposed else 0.0,
            "spec_mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
        }
