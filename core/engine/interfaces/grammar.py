"""GrammarBackend: structured outputs. The core keeps one :class:`Grammar` per constrained
request, asks it for a token bitmask each step, masks the logits in one batched op, and
feeds it the sampled tokens.

Bitmask format (xgrammar's): int32 tensor [batch, ceil(vocab / 32)], bit ``t % 32`` of
word ``t // 32`` set when token ``t`` is allowed.
"""

from abc import ABC, abstractmethod
from typing import Any

import attrs
import torch

from engine.sampling_params import GrammarSpec


@attrs.frozen
class GrammarContext:
    """What a grammar backend is constructed with."""

    tokenizer: Any  # the model's transformers tokenizer
    vocab_size: int  # the model's logits width (bitmask rows cover it)


class Grammar(ABC):
    @abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance; False (and no change) if a token is not allowed."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]``."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected drafts)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        ...

    @abstractmethod
    def reset(self) -> None:
        ...


class GrammarBackend(ABC):
    def __init__(self, ctx: Any):
        """``ctx`` is a :class:`GrammarContext` (tokenizer, vocab size)."""
        self.ctx = ctx

    @classmethod
    def supports(cls, spec: GrammarSpec) -> list[str]:
        return []

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Grammar:
        """Compile (called off the step loop, on a worker thread). Raise ValueError for an
        invalid spec; that request alone fails."""
