"""The engine's statistics as one typed message: what a front end reads of the engine core (the
server's ``/metrics``, the ``--log-stats`` line), the same in this process and over the wire.

Counters are running totals since the engine started (a reader takes differences); gauges are
the values now. The field names are the stat names: nothing else spells them."""

from __future__ import annotations

import attrs


@attrs.frozen
class TokensPerStep:
    """Tokens computed per engine step as a cumulative histogram (vLLM's ``iteration_tokens_total``):
    (upper bound, steps with at most that many tokens) pairs, ``"+Inf"`` last, and the tokens' sum."""

    buckets: tuple[tuple[str, int], ...] = ()
    sum: int = 0


@attrs.frozen
class EngineStats:
    # the scheduler's queues and refusals
    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    rejected_queue_full: int = 0  # refused on arrival (max_queued_requests)
    rejected_queue_wait: int = 0  # finished unscheduled (max_queue_wait)
    # the KV cache and its prefix cache (tokens)
    kv_cache_usage: float = 0.0  # fraction of blocks in use, 0..1
    prefix_queries: int = 0
    prefix_hits: int = 0
    # tokens through the engine: prompts (counted when their first token comes) and samples
    prompt_tokens: int = 0
    generation_tokens: int = 0
    tokens_per_step: TokensPerStep = TokensPerStep()
    # speculative decoding
    spec_drafts: int = 0  # verifications of drafted requests
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()  # accepted drafts by draft position (0 = first)
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0  # tokens per verification: accepted drafts + 1
    # a multimodal model's encoder: images encoded, and a step's image rows the encoder cache served
    mm_encoder_runs: int = 0
    mm_encoder_cache_hits: int = 0
    # a KV connector's traffic
    external_prefix_queries: int = 0  # prompt tokens looked up through the connector
    external_prefix_hits: int = 0  # ... and loaded
    kv_load_failures: int = 0  # requests whose load failed (recomputed)
    kv_load_bytes: int = 0
    kv_load_seconds: float = 0.0
    kv_save_bytes: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        """Prefix cache hits / queries since the start, in tokens (0 before any query)."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def rejected(self) -> dict[str, int]:
        """Requests refused as overloaded, by reason (vLLM's ``num_requests_rejected`` labels)."""
        return {"queue_full": self.rejected_queue_full, "queue_wait": self.rejected_queue_wait}
