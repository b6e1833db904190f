"""Drafter: proposes draft tokens for speculative decoding. The core verifies them in one
target pass with an exact rejection sampler, so a drafter never changes what is
generated (greedy) or its distribution (sampling), only how fast.

After every step the core asks the drafter for each decoding request's next drafts. A
drafter that runs a model gets what it needs from :class:`DrafterContext` (the target
model, its attention backend and KV caches, a loader for a separate draft model) and,
if it sets ``needs_hidden_states``, the target's hidden states of the positions each
request just had verified.

Under tensor parallelism the core asks on rank 0 only, and the drafts reach the other ranks
as tokens of the next step's input. A drafter that calls the target's layers (sharded: each
call a collective every rank must join) sets ``drafts_on_every_rank``: every rank then builds
it, over its own share of the target, and runs each ``propose`` and ``finished`` call with the
same arguments; rank 0's drafts count, and the drafter makes the other ranks agree with them
through ``DrafterContext.share`` wherever its choices steer further collectives.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar


def _same(value):
    return value


import attrs
import torch


@attrs.frozen
class DraftRequest:
    request_id: str
    token_ids: Sequence[int]  # prompt + output so far, read-only
    max_tokens: int  # ceiling for this request this step
    block_ids: Sequence[int] = ()  # the target's block table, with slots for max_tokens drafts
    sampling_params: Any = None
    hidden_states: torch.Tensor | None = None  # [n, hidden]: the last n known positions, if asked for


@attrs.frozen
class Draft:
    token_ids: list[int]
    probs: torch.Tensor | None = (
        None  # [len(token_ids), vocab]: what each was drawn from; None: chosen outright
    )


@attrs.frozen
class DrafterContext:
    config: Any  # EngineConfig; config.speculative_config holds the user's dict
    target: Any  # the target Model
    attention: Any  # the target's AttentionBackend instance
    kv_caches: list[torch.Tensor]  # the target's, one per layer
    num_blocks: int
    device: torch.device
    dtype: torch.dtype
    tokenizer: Any
    # (path, architecture=None) -> Model, built like the target (same platform and dtype); (v2)
    # path None: the target's own checkpoint; architecture: that registered one instead of the
    # checkpoint's (the target's MTP module: ``Model.mtp_architecture``)
    load_model: Callable[..., Any]
    make_attention: Callable[[Any], Any]  # Model -> an AttentionBackend for its KV layout
    # (v3) rank 0's value on every tensor-parallel rank (rank 0 passes it, the others anything,
    # all at the same point of the same call); at one rank the value itself. ``tokenizer`` is
    # None on ranks other than 0
    share: Callable[[Any], Any] = _same


class Drafter(ABC):
    needs_hidden_states: ClassVar[bool] = False
    # (v3) under tensor parallelism, built and called on every rank, not on rank 0 alone
    drafts_on_every_rank: ClassVar[bool] = False

    def __init__(self, ctx: DrafterContext):
        self.ctx = ctx
        self.method_config = dict(ctx.config.speculative_config or {})

    def hidden_state_layers(self) -> tuple[int, ...] | None:
        """With ``needs_hidden_states``: None for the target's output hidden states, or the
        layers whose residual streams (concatenated, in this order) the drafter reads."""
        return None

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """One :class:`Draft` per request (ragged; empty drafts allowed)."""

    def finished(self, request_ids: Sequence[str]) -> None:
        """Forget per-request state of requests that finished or were preempted."""
