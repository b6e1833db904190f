"""LogitsProcessor: a batch-level transformation of the logits before sampling.

Enabled per engine with ``logits_processors=[NAME]``; constructed once with the
:class:`engine.config.EngineConfig`. ``apply`` sees the logits rows of the requests
that sample this step, in order, and the requests themselves (read their
``sampling_params`` — e.g. ``extra_args`` — ``prompt_token_ids`` and ``output_token_ids``).
Processors run after the grammar mask and after logprobs are taken (vLLM's default
``raw_logprobs``), before the built-in token masks and penalties (docs/sampling.md).
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch


class LogitsProcessor(ABC):
    def __init__(self, ctx: Any):
        self.ctx = ctx

    @abstractmethod
    def apply(self, logits: torch.Tensor, requests: Sequence[Any]) -> torch.Tensor:
        """logits [N, vocab] float32 -> logits (in place or new)."""
