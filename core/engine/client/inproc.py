"""The engine core in this process, driven as every client drives it: ``LLM`` and ``engine
generate`` hold one, and the engine-core process serves one over its sockets. Requests go in
as (id, prompt, parameters); each :meth:`InProcessClient.step` returns the step's outputs as
:class:`Delta` messages (sharing the core's lists, nothing encoded); the statistics come as
one :class:`EngineStats`. With ``log_stats`` it logs them every few seconds while it steps."""

from __future__ import annotations

import attrs

from engine.client.base import Child, EngineCoreClient
from engine.client.protocol import CONTROL_METHODS, Delta, Ready
from engine.client.stats_logger import StatsLogger
from engine.core.engine_core import EngineCore
from engine.core.speculation import ACCEPTED_AT
from engine.core.step_stats import PREFIX as STEP_TOKENS
from engine.core.step_stats import step_token_buckets
from engine.messages.lora import LoRARequest
from engine.messages.multimodal import MultiModalItem
from engine.messages.pooling_params import matryoshka_of
from engine.messages.request import Request
from engine.messages.stats import EngineStats, TokensPerStep
from engine.messages.step import EngineOutput

# EngineStats' plain numbers, each with its type: the core's counters of those names become them
_NUMBERS = {f.name: f.type for f in attrs.fields(attrs.resolve_types(EngineStats)) if f.type in (int, float)}


class InProcessClient(EngineCoreClient):
    def __init__(self, core: EngineCore, stats_label: str = "engine"):
        self.core = core
        self._prompt_lengths: dict[str, int] = {}  # requests whose prompt is not counted yet
        self._prompt_tokens = self._generation_tokens = 0
        log = core.config.observability.log_stats
        self._stats_log = StatsLogger(stats_label) if log else None

    @property
    def ready(self) -> Ready:
        core, hf = self.core, self.core.text_config
        matryoshka, dimensions = matryoshka_of(hf)
        return Ready(
            core.config.model.model,
            core.max_model_len,
            hf.vocab_size,
            core.eos_token_id,
            core.default_sampling_params,
            core.cache_info(),
            core.runner_kind,
            core.embedding_size,
            matryoshka,
            list(dimensions) if dimensions else None,
            core.determinism(),
            core.startup.render(),
            core.classifier_labels,
        )

    def control(self, method: str, **arguments):
        """Call one of the core's :data:`~engine.client.protocol.CONTROL_METHODS` (sleep mode,
        weight updates, the prefix cache) and return what it returns."""
        if method not in CONTROL_METHODS:
            raise ValueError(f"no engine control {method!r} (known: {', '.join(CONTROL_METHODS)})")
        return getattr(self.core, method)(**arguments)

    def validate(
        self,
        prompt_token_ids: list[int],
        params,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        mm_items: tuple[MultiModalItem, ...] = (),
    ) -> None:
        """What :meth:`add` would refuse, raised before anything is queued."""
        self.core.validate(prompt_token_ids, params, priority, lora_request, mm_items)

    def add(
        self,
        children: list[Child],
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
        lora_request: LoRARequest | None = None,
        mm_items: tuple[MultiModalItem, ...] = (),
    ) -> None:
        """Raises what the core refuses (ValueError, :class:`engine.messages.step.Overloaded`) for the
        first child it refuses; the children before it stay queued."""
        for request_id, prompt, params in children:
            self.core.add_request(
                Request(
                    request_id,
                    prompt,
                    params,
                    priority=priority,
                    cache_salt=cache_salt,
                    kv_transfer_params=kv_transfer_params,
                    lora_request=lora_request,
                    mm_items=mm_items,
                )
            )
            self._prompt_lengths[request_id] = len(prompt)

    def abort(self, request_ids: list[str]) -> None:
        self.core.abort(request_ids)
        for request_id in request_ids:
            self._prompt_lengths.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[Delta]:
        """One engine step's outputs."""
        deltas = [self._delta(out) for out in self.core.step()]
        if self._stats_log is not None:
            self._stats_log.tick(self.stats)
        return deltas

    def _delta(self, out: EngineOutput) -> Delta:
        self._count(out)
        return Delta(
            out.request_id,
            out.new_token_ids,
            _entries(out.new_logprobs),
            _entries(out.new_prompt_logprobs),
            out.finish_reason,
            out.stop_reason,
            out.num_cached_tokens,
            out.error,
            out.error_code,
            None if out.timing is None else (out.timing.queue, out.timing.prefill),
            None if out.pooled is None else out.pooled.numpy().astype("<f4").tobytes(),
            out.kv_transfer_params,
            out.num_draft_tokens,
            out.num_accepted_tokens,
        )

    def _count(self, out: EngineOutput) -> None:
        """Tokens through the engine: a prompt counts once its first token (or its vector) came."""
        self._generation_tokens += len(out.new_token_ids)
        if out.timing is not None or out.finish_reason is not None:
            length = self._prompt_lengths.pop(out.request_id, 0)
            if out.timing is not None or out.pooled is not None:
                self._prompt_tokens += length

    def stats(self) -> EngineStats:
        counters = self.core.stats()
        per_pos = sorted(
            (int(key[len(ACCEPTED_AT) :]), n) for key, n in counters.items() if key.startswith(ACCEPTED_AT)
        )
        per_step = TokensPerStep(
            tuple((le, int(n)) for le, n in step_token_buckets(counters)),
            int(counters.get(f"{STEP_TOKENS}_sum", 0)),
        )
        numbers = {key: _NUMBERS[key](value) for key, value in counters.items() if key in _NUMBERS}
        return EngineStats(
            **numbers,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            tokens_per_step=per_step,
            spec_accepted_per_pos=tuple(int(n) for _, n in per_pos),
        )

    def shutdown(self) -> None:
        self.core.shutdown()


def _entries(items) -> list[tuple] | None:
    """Logprob entries as the wire carries them: (token ids, logprobs, ranks), the chosen token first."""
    return None if items is None else [(e.token_ids, e.logprobs, e.ranks) for e in items]
