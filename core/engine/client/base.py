"""What every client of the engine core offers its front end, wherever the core runs (vLLM's
``EngineCoreClient``): the core's facts, and requests in and out. How the outputs come back
is the client's kind: :class:`~engine.client.InProcessClient` steps the core when asked
(``step``), :class:`~engine.client.AsyncMPClient` awaits the core process's next message."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from engine.client.protocol import Ready
from engine.messages.lora import LoRARequest
from engine.messages.multimodal import MultiModalItem
from engine.messages.pooling_params import PoolingParams
from engine.messages.sampling_params import SamplingParams

# one engine request of a front-end request: (request id, prompt token ids, parameters)
Child = tuple[str, Sequence[int], SamplingParams | PoolingParams]


class EngineCoreClient(ABC):
    ready: Ready | None  # the core's facts (model, context, vocabulary, defaults), once it started

    @abstractmethod
    def add(
        self,
        children: list[Child],
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
        lora_request: LoRARequest | None = None,
        mm_items: tuple[MultiModalItem, ...] = (),
    ) -> None:
        """Queue the engine requests of one front-end request (its prompts and samples), all
        before the core's next step, so they start together; ``lora_request``: the LoRA adapter
        they all run with (None: the base model); ``mm_items``: the prompt's images
        (:func:`engine.messages.multimodal.expand_placeholders`)."""

    @abstractmethod
    def abort(self, request_ids: list[str]) -> None:
        """Finish these requests now (unknown or finished ids are ignored)."""
