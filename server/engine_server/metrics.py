"""Prometheus metrics under vLLM's names (``vllm:`` prefix by default, ``--metrics-prefix
engine`` for this engine's own), so vLLM's Grafana dashboard and alerts read them unchanged.

Request latencies and lengths are measured in the API process as the tokens arrive; the
queue and prefill times come from the engine core with each request's first token
(:class:`engine.messages.step.RequestTiming`); gauges, counters and the tokens-per-step
histogram come from the :class:`~engine.messages.stats.EngineStats` the core sends. Buckets are vLLM's."""

from __future__ import annotations

import collections
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from engine.messages.stats import EngineStats

PREFIXES = ("vllm", "engine")
_TTFT = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_PER_TOKEN = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_PER_REQUEST = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
_TOKENS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))[:19]  # 1, 2, 5, 10 ... 1e6 (1-2-5 as vLLM)
_N = (1, 2, 5, 10, 20)


# EngineStats field -> (counter name, help) of a KV connector's counters
KV_CONNECTOR_COUNTERS = {
    "external_prefix_queries": (
        "external_prefix_cache_queries",
        "Prompt tokens looked up through the KV connector",
    ),
    "external_prefix_hits": ("external_prefix_cache_hits", "Prompt tokens the KV connector loaded"),
    "kv_load_failures": ("kv_connector_load_failures", "Requests whose KV load failed (recomputed)"),
    "kv_load_bytes": ("kv_connector_load_bytes", "Bytes of KV the connector loaded"),
    "kv_load_seconds": ("kv_connector_load_seconds", "Seconds the connector's loads took"),
    "kv_save_bytes": ("kv_connector_save_bytes", "Bytes of KV the connector saved"),
}


class Metrics:
    def __init__(self, model_name: str, prefix: str = "vllm"):
        if prefix not in PREFIXES:
            raise ValueError(f"metrics prefix must be one of {', '.join(PREFIXES)}, got {prefix!r}")
        self.registry = CollectorRegistry()
        self.prefix = prefix
        self._labels = {"model_name": model_name}
        self.finished = Counter(
            self._name("request_success"),
            "Finished requests by finish reason",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._request_histograms()
        self._engine_metrics()
        self._stats: dict[str, EngineStats] = {}
        self.registry.register(_StepTokens(self))
        self.lora: LoRAActivity | None = None

    def enable_lora(self, max_loras: int) -> None:
        """Publish ``lora_requests_info`` (vLLM's) and the per-adapter request counter."""
        self.lora = LoRAActivity(self, max_loras)
        self.registry.register(self.lora)

    def _name(self, name: str) -> str:
        return f"{self.prefix}:{name}"

    def _gauge(self, name: str, doc: str):
        return Gauge(self._name(name), doc, ["model_name"], registry=self.registry).labels(**self._labels)

    def _counter(self, name: str, doc: str):
        return Counter(self._name(name), doc, ["model_name"], registry=self.registry).labels(**self._labels)

    def _histogram(self, name: str, doc: str, buckets):
        return Histogram(
            self._name(name), doc, ["model_name"], buckets=buckets, registry=self.registry
        ).labels(**self._labels)

    def _request_histograms(self) -> None:
        h = self._histogram
        self.ttft = h("time_to_first_token_seconds", "Time to first token", _TTFT)
        self.itl = h("inter_token_latency_seconds", "Time between consecutive output tokens", _PER_TOKEN)
        self.tpot = h(
            "time_per_output_token_seconds",
            "Time per output token, observed per token as vLLM "
            "does (the same intervals as inter_token_latency_seconds)",
            _PER_TOKEN,
        )
        self.request_tpot = h(
            "request_time_per_output_token_seconds",
            "Decode time / (output tokens - 1), per request",
            _PER_TOKEN,
        )
        self.e2e = h("e2e_request_latency_seconds", "End-to-end request latency", _PER_REQUEST)
        self.queue_time = h(
            "request_queue_time_seconds",
            "Time from reaching the engine core to first scheduled",
            _PER_REQUEST,
        )
        self.prefill_time = h(
            "request_prefill_time_seconds", "Time from first scheduled to first token", _PER_REQUEST
        )
        self.decode_time = h(
            "request_decode_time_seconds", "Time from first token to last token", _PER_REQUEST
        )
        self.inference_time = h("request_inference_time_seconds", "Prefill plus decode time", _PER_REQUEST)
        self.request_prompt_tokens = h("request_prompt_tokens", "Prompt tokens per finished request", _TOKENS)
        self.request_generation_tokens = h(
            "request_generation_tokens", "Output tokens per finished request", _TOKENS
        )
        self.max_generation_tokens = h(
            "request_max_num_generation_tokens",
            "Most output tokens of one sample, per prompt with its n samples",
            _TOKENS,
        )
        self.params_max_tokens = h("request_params_max_tokens", "The max_tokens of each request", _TOKENS)
        self.params_n = h("request_params_n", "The n of each request", _N)
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = self._counter("generation_tokens", "Tokens generated")

    def _engine_metrics(self) -> None:
        """The families of the engine cores' gauges and counters, labelled ``engine`` (the
        data-parallel replica: "0" .. "N-1", as vLLM labels them); :meth:`update_engine`
        fills one replica's children."""
        labels = ["model_name", "engine"]

        def gauge(name, doc):
            return Gauge(self._name(name), doc, labels, registry=self.registry)

        def counter(name, doc, extra=()):
            return Counter(self._name(name), doc, [*labels, *extra], registry=self.registry)

        # (the EngineStats field each reads, the gauge)
        self.gauges = [
            ("running", gauge("num_requests_running", "Requests in the running batch")),
            ("waiting", gauge("num_requests_waiting", "Requests waiting to be scheduled")),
            ("kv_cache_usage", gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1)")),
            (
                "kv_cache_usage",
                gauge(
                    "gpu_cache_usage_perc",
                    "Fraction of KV cache blocks in use (0..1); the "
                    "name vLLM's example dashboard reads, as kv_cache_usage_perc",
                ),
            ),
            ("prefix_hit_rate", gauge("prefix_cache_hit_rate", "Prefix cache hits / queries, in tokens")),
            (
                "spec_acceptance_rate",
                gauge("spec_decode_draft_acceptance_rate", "Accepted / proposed draft tokens"),
            ),
            (
                "spec_mean_accepted_length",
                gauge("spec_decode_mean_acceptance_length", "Tokens per verification: accepted drafts + 1"),
            ),
        ]
        self.counter_families = {  # by the EngineStats field each counts
            "spec_drafts": counter("spec_decode_num_drafts", "Verifications of drafted requests"),
            "spec_draft_tokens": counter("spec_decode_num_draft_tokens", "Draft tokens verified"),
            "spec_accepted_tokens": counter("spec_decode_num_accepted_tokens", "Draft tokens accepted"),
            "preemptions": counter("num_preemptions", "Requests preempted"),
            "prefix_queries": counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
            "prefix_hits": counter("prefix_cache_hits", "Prompt tokens found in the prefix cache"),
            "mm_encoder_runs": counter("mm_encoder_runs", "Images the multimodal encoder encoded"),
            "mm_encoder_cache_hits": counter(
                "mm_encoder_cache_hits",
                "Image encoder outputs the encoder cache served (one per step computing an image's rows)",
            ),
            **{key: counter(name, doc) for key, (name, doc) in KV_CONNECTOR_COUNTERS.items()},
        }
        self._rejected = counter(
            "num_requests_rejected",
            "Requests refused as overloaded, by reason "
            "(queue_full: max_queued_requests; queue_wait: max_queue_wait)",
            ["reason"],
        )
        self._accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by draft position",
            ["position"],
        )
        self._engines: dict[str, _EngineCounters] = {}

    def engine_ready(self, cache_info: dict[str, str], engines: int = 1) -> None:
        """Publish the engine's KV cache configuration (``cache_config_info``: value 1, the
        configuration in its labels), and every core's gauges and counters at 0 until its
        first stats arrive (a dashboard reads them from the start)."""
        names = ["model_name", *cache_info]
        Gauge(
            self._name("cache_config_info"),
            "Information of the KV cache configuration",
            names,
            registry=self.registry,
        ).labels(**self._labels, **cache_info).set(1)
        for engine in range(engines):
            self.update_engine(EngineStats(), engine)

    def update_engine(self, stats: EngineStats, engine: int = 0) -> None:
        """One engine core's (data-parallel replica's) latest stats."""
        label = str(engine)
        self._stats[label] = stats
        labels = {**self._labels, "engine": label}
        for field, family in self.gauges:
            family.labels(**labels).set(getattr(stats, field))
        if label not in self._engines:
            self._engines[label] = _EngineCounters(self, labels)
        self._engines[label].update(stats)

    def engine_stats(self) -> dict[str, EngineStats]:
        """The latest stats of each engine core, by its ``engine`` label."""
        return self._stats

    def start_request(
        self,
        num_prompt_tokens: int,
        max_tokens: int | None,
        n: int,
        lora_name: str | None = None,
        submitted: float | None = None,
    ) -> list[RequestTimer]:
        """One prompt with its ``n`` samples (vLLM's parent request): a timer per sample;
        ``lora_name``: the LoRA adapter they run with (None: the base model); ``submitted``:
        when they were sent to the engine (``time.monotonic()``; None: now)."""
        group = _SampleGroup(self, n)
        self.params_n.observe(n)
        if max_tokens is not None:
            self.params_max_tokens.observe(max_tokens)
        self.prompt_tokens.inc(num_prompt_tokens * n)
        lora = None if lora_name is None or self.lora is None else (self.lora, lora_name)
        return [RequestTimer(self, num_prompt_tokens, group, lora, submitted) for _ in range(n)]

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCounters:
    """One engine core's counters: the stats carry running totals, Prometheus wants increments.
    A counter is keyed by its EngineStats field, or ("reason", r) and ("position", p) for the
    labelled rejections and accepted drafts."""

    def __init__(self, metrics: Metrics, labels: dict[str, str]):
        self.metrics, self.labels = metrics, labels
        self.counters = {key: family.labels(**labels) for key, family in metrics.counter_families.items()}
        self.seen = dict.fromkeys(self.counters, 0.0)

    def update(self, stats: EngineStats) -> None:
        totals = {key: getattr(stats, key) for key in self.metrics.counter_families}
        totals.update({("reason", reason): n for reason, n in stats.rejected.items()})
        totals.update({("position", str(pos)): n for pos, n in enumerate(stats.spec_accepted_per_pos)})
        for key, total in totals.items():
            if key not in self.counters:
                self.counters[key], self.seen[key] = self._labelled(*key), 0.0
            if total > self.seen[key]:
                self.counters[key].inc(total - self.seen[key])
                self.seen[key] = total

    def _labelled(self, label: str, value: str):
        family = self.metrics._rejected if label == "reason" else self.metrics._accepted_per_pos
        return family.labels(**self.labels, **{label: value})


class _SampleGroup:
    """Observes the longest output of a prompt's samples once all of them finished."""

    def __init__(self, metrics: Metrics, n: int):
        self.metrics, self.pending, self.longest = metrics, n, 0

    def sample_finished(self, num_tokens: int) -> None:
        self.pending -= 1
        self.longest = max(self.longest, num_tokens)
        if self.pending == 0:
            self.metrics.max_generation_tokens.observe(self.longest)


class LoRAActivity(Collector):
    """vLLM's ``lora_requests_info`` gauge: its labels name the adapters with requests running
    (``running_lora_adapters``: the engine has produced a token of them) and waiting (queued or
    in prefill), comma-separated, and ``max_lora`` (``--max-loras``); its value is the time of the
    last change, as vLLM's. Beside it ``lora_requests_total``: engine requests (samples) started
    per adapter."""

    def __init__(self, metrics: Metrics, max_loras: int):
        self.metrics, self.max_loras = metrics, max_loras
        self.waiting: collections.Counter[str] = collections.Counter()
        self.running: collections.Counter[str] = collections.Counter()
        self.updated = time.time()
        self.requests = Counter(
            metrics._name("lora_requests"),
            "Engine requests (samples) started, by LoRA adapter",
            ["model_name", "lora_name"],
            registry=metrics.registry,
        )

    def submitted(self, name: str) -> None:
        self.requests.labels(**self.metrics._labels, lora_name=name).inc()
        self._move(name, None, self.waiting)

    def started(self, name: str) -> None:
        self._move(name, self.waiting, self.running)

    def ended(self, name: str, started: bool) -> None:
        self._move(name, self.running if started else self.waiting, None)

    def _move(self, name: str, source, target) -> None:
        if source is not None:
            source[name] -= 1
        if target is not None:
            target[name] += 1
        self.updated = time.time()

    def collect(self):
        family = GaugeMetricFamily(
            self.metrics._name("lora_requests_info"),
            "Running stats on LoRA requests",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        family.add_metric([str(self.max_loras), _names(self.waiting), _names(self.running)], self.updated)
        yield family


def _names(counts: collections.Counter[str]) -> str:
    """The adapters with requests, comma-separated, as vLLM's label."""
    return ",".join(sorted(name for name, count in counts.items() if count > 0))


class RequestTimer:
    """One engine request's latencies, measured as its tokens arrive; ``lora``: (the LoRA
    activity, the adapter's name) when it runs with an adapter."""

    def __init__(
        self,
        metrics: Metrics,
        num_prompt_tokens: int,
        group: _SampleGroup,
        lora: tuple[LoRAActivity, str] | None = None,
        submitted: float | None = None,
    ):
        self.metrics, self.num_prompt_tokens, self.group = metrics, num_prompt_tokens, group
        self.lora = lora
        if lora is not None:
            lora[0].submitted(lora[1])
        self.start = self.last = time.monotonic() if submitted is None else submitted
        self.first_token: float | None = None
        self.num_tokens = 0
        self.timing: tuple[float, float] | None = None  # (queue, prefill) seconds from the engine core

    def tokens(self, count: int, timing: tuple[float, float] | None = None) -> None:
        """``count`` tokens arrived now (several when drafts were accepted); ``timing`` comes
        with the first."""
        if timing is not None:
            self.timing = timing
        if not count:
            return
        now = time.monotonic()
        m = self.metrics
        m.generation_tokens.inc(count)
        self.num_tokens += count
        if self.first_token is None:
            m.ttft.observe(now - self.start)
            self.first_token = now
            if self.lora is not None:
                self.lora[0].started(self.lora[1])
        else:
            interval = (now - self.last) / count
            for _ in range(count):
                m.itl.observe(interval)
                m.tpot.observe(interval)
        self.last = now

    def released(self) -> None:
        """The request ended, however (finished, aborted, failed): it leaves the LoRA activity."""
        if self.lora is not None:
            activity, name = self.lora
            self.lora = None
            activity.ended(name, started=self.first_token is not None)

    def finished(self, reason: str) -> None:
        self.released()
        m = self.metrics
        m.e2e.observe(time.monotonic() - self.start)
        m.finished.labels(**m._labels, finished_reason=reason).inc()
        m.request_prompt_tokens.observe(self.num_prompt_tokens)
        m.request_generation_tokens.observe(self.num_tokens)
        self.group.sample_finished(self.num_tokens)
        if self.timing is not None and self.first_token is not None:
            queue, prefill = self.timing
            decode = self.last - self.first_token
            m.queue_time.observe(queue)
            m.prefill_time.observe(prefill)
            m.decode_time.observe(decode)
            m.inference_time.observe(prefill + decode)
            if self.num_tokens > 1:
                m.request_tpot.observe(decode / (self.num_tokens - 1))


class _StepTokens(Collector):
    """``iteration_tokens_total``: the engine core's cumulative tokens-per-step histogram."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        family = HistogramMetricFamily(
            self.metrics._name("iteration_tokens_total"),
            "Tokens per engine step",
            labels=["model_name", "engine"],
        )
        for engine, stats in self.metrics.engine_stats().items():
            steps = stats.tokens_per_step
            if steps.buckets:
                labels = [self.metrics._labels["model_name"], engine]
                family.add_metric(labels, list(steps.buckets), steps.sum)
        yield family
