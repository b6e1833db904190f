"""Prometheus metrics: request latencies measured in the API process, engine gauges and
counters from the stats the engine core sends."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

REJECTION_REASONS = ("queue_full", "queue_wait")  # the scheduler's stats rejected_<reason>
_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class Metrics:
    def __init__(self, model_name: str):
        r = self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self.finished = Counter("engine:request_success", "Finished requests by finish reason",
                                ["model_name", "finished_reason"], registry=r)
        self._labels = labels

        def gauge(name, doc):
            return Gauge(f"engine:{name}", doc, ["model_name"], registry=r).labels(**labels)

        def counter(name, doc):
            return Counter(f"engine:{name}", doc, ["model_name"], registry=r).labels(**labels)

        def histogram(name, doc):
            return Histogram(f"engine:{name}", doc, ["model_name"], buckets=_LATENCY, registry=r).labels(**labels)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens")
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency")
        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1)")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "Prefix cache hits / queries, in tokens")
        self.spec_acceptance = gauge("spec_decode_draft_acceptance_rate", "Accepted / proposed draft tokens")
        self.spec_length = gauge("spec_decode_mean_acceptance_length",
                                 "Tokens per verification: accepted drafts + 1")
        self.counters = {
            "spec_drafts": counter("spec_decode_num_drafts", "Verifications of drafted requests"),
            "spec_draft_tokens": counter("spec_decode_num_draft_tokens", "Draft tokens verified"),
            "spec_accepted_tokens": counter("spec_decode_num_accepted_tokens", "Draft tokens accepted"),
            "preemptions": counter("num_preemptions", "Requests preempted"),
            "prefix_queries": counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
            "prefix_hits": counter("prefix_cache_hits", "Prompt tokens found in the prefix cache"),
        }
        rejected = Counter("engine:num_requests_rejected", "Requests refused as overloaded, by reason "
                           "(queue_full: max_queued_requests; queue_wait: max_queue_wait)",
                           ["model_name", "reason"], registry=r)
        for reason in REJECTION_REASONS:
            self.counters[f"rejected_{reason}"] = rejected.labels(**labels, reason=reason)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self._seen = {k: 0.0 for k in self.counters}

    def update_engine(self, stats: dict[str, float]) -> None:
        self.running.set(stats.get("running", 0))
        self.waiting.set(stats.get("waiting", 0))
        self.kv_usage.set(stats.get("kv_cache_usage", 0))
        queries, hits = stats.get("prefix_queries", 0), stats.get("prefix_hits", 0)
        self.prefix_hit_rate.set(hits / queries if queries else 0.0)
        self.spec_acceptance.set(stats.get("spec_acceptance_rate", 0.0))
        self.spec_length.set(stats.get("spec_mean_accepted_length", 0.0))
        for key, metric in self.counters.items():
            value = stats.get(key, 0.0)
            if value > self._seen[key]:
                metric.inc(value - self._seen[key])
                self._seen[key] = value

    def request_timer(self, num_prompt_tokens: int) -> RequestTimer:
        self.prompt_tokens.inc(num_prompt_tokens)
        return RequestTimer(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.start = self.last = time.monotonic()
        self.first = True

    def tokens(self, count: int) -> None:
        """``count`` tokens arrived now (several when drafts were accepted)."""
        if not count:
            return
        now = time.monotonic()
        self.metrics.generation_tokens.inc(count)
        if self.first:
            self.metrics.ttft.observe(now - self.start)
            self.first, count = False, count - 1
        elif count:
            for _ in range(count):
                self.metrics.itl.observe((now - self.last) / count)
        self.last = now

    def finished(self, reason: str) -> None:
        self.metrics.e2e.observe(time.monotonic() - self.start)
        self.metrics.finished.labels(**self.metrics._labels, finished_reason=reason).inc()
