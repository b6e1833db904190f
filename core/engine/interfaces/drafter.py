"""Drafter: proposes draft tokens for speculative decoding. The core verifies them in one
target pass with an exact rejection sampler, so a drafter never changes what is generated,
only how fast."""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import attrs


@attrs.frozen
class DraftRequest:
    request_id: str
    token_ids: Sequence[int]  # prompt + output so far, read-only
    max_tokens: int  # ceiling for this request this step


class Drafter(ABC):
    def __init__(self, ctx: Any):
        """``ctx`` is the :class:`engine.config.EngineConfig`; ``ctx.speculative`` holds the
        user's ``speculative_config`` dict."""
        self.ctx = ctx

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Draft tokens per request (ragged; empty lists allowed)."""
