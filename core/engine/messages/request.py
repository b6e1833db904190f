"""Request: one sequence's state inside the engine core."""

from __future__ import annotations

import enum
import itertools
from typing import Any

import torch

from engine.messages.lora import LoRARequest
from engine.messages.multimodal import MultiModalItem
from engine.messages.pooling_params import PoolingParams
from engine.messages.sampling_params import SamplingParams

_arrivals = itertools.count()
# what a pooling request's ``sampling_params`` read: it samples nothing, and the scheduler's
# checks (prompt log-probs, stop conditions) see a plain one-token request
POOLING_SAMPLING = SamplingParams(max_tokens=1)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # parked: does not block the queue
    WAITING_FOR_KV = "waiting_for_kv"  # parked while a KV connector loads its prefix asynchronously
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """Public read-only fields for plugins: ``request_id``, ``sampling_params``,
    ``pooling_params``, ``prompt_token_ids``, ``output_token_ids``, ``all_token_ids``,
    ``num_computed_tokens``, ``kv_transfer_params`` (vLLM's P/D field, for the KV connector),
    ``lora_request`` (the LoRA adapter it runs with, or None: the base model), ``mm_items``
    (its images: placeholder spans, content hashes, processed inputs; empty for text).

    Given :class:`PoolingParams` the request pools: ``pooling_params`` holds them, it runs
    its whole prompt in one step and finishes with a vector, never a token."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        eos_token_id: int | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
        lora_request: LoRARequest | None = None,
        mm_items: tuple[MultiModalItem, ...] = (),
    ):
        self.request_id = request_id
        self.pooling_params = params if isinstance(params, PoolingParams) else None
        sampling_params = POOLING_SAMPLING if self.pooling_params is not None else params
        self.sampling_params = sampling_params
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.eos_token_id = eos_token_id
        self.priority = priority
        self.cache_salt = cache_salt
        self.kv_transfer_params = kv_transfer_params
        self.lora_request = lora_request
        self.mm_items = tuple(mm_items)
        self.arrival = next(_arrivals)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache at first admission
        self.num_preemptions = 0
        # prompt positions (from 1) whose log-probs were sent: a prompt recomputed after
        # preemption does not send them again
        self.num_prompt_logprobs = 0
        self.spec_token_ids: list[int] = []
        self.spec_probs = None  # [len(spec_token_ids), vocab] draft distribution, or None: deterministic
        self.num_draft_tokens = 0  # verified drafts, and how many of them were accepted
        self.num_accepted_tokens = 0
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks, filled by the KV manager
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.grammar: Any = None  # engine.interfaces.Grammar once compiled
        seed = sampling_params.seed
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)
        # time.monotonic() stamps the engine core sets: queued (added), first scheduled, first token
        self.queued_time: float | None = None
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None

    @property
    def lora_id(self) -> int | None:
        """The adapter's ``lora_int_id``, or None for the base model."""
        return None if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens})"
