"""Request tracing with OpenTelemetry (``--otlp-traces-endpoint``, vLLM's flag).

One ``llm_request`` span per HTTP request, a child of the caller's span when the request
carries a W3C ``traceparent`` header. Under it, spans that tile the request's wall time:
``api.prepare`` (body, template, tokenizing, validation), one ``engine_request`` per
sample with ``queue`` / ``prefill`` / ``decode`` children (the engine core's own queue and
prefill times, the API's token arrival times), and ``api.respond`` (the last token to the
response's end). Attributes use vLLM's ``gen_ai.*`` names.

The spans are made when the request ends, from the timings the metrics already take, so a
request pays nothing while it runs; the SDK's batch processor exports them off the event
loop. ``--collect-detailed-traces`` adds an event per token delta on each ``decode`` span.

The exporter speaks OTLP over HTTP/protobuf (``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc``
uses gRPC where ``opentelemetry-exporter-otlp-proto-grpc`` is installed). The SDK and the
exporter are the server's ``tracing`` extra: without them the flag is refused at start-up,
in one line naming the command that installs them."""

from __future__ import annotations

import os
import time

DETAIL_LEVELS = ("model", "worker", "all")  # vLLM's --collect-detailed-traces values
MISSING = (
    "--otlp-traces-endpoint needs OpenTelemetry's SDK and OTLP exporter: "
    "pip install 'tessellm-server[tracing]'"
)


def _monotonic_to_epoch_ns() -> int:
    """Add to ``time.monotonic_ns()`` for wall-clock nanoseconds (what span times are)."""
    return time.time_ns() - time.monotonic_ns()


def _exporter(endpoint: str):
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
    else:
        raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r}: use http/protobuf or grpc")
    return OTLPSpanExporter(endpoint=endpoint)


class Tracing:
    """The server's tracer: built once at start-up, shut down (flushing) at exit."""

    def __init__(self, service_name: str, endpoint: str | None = None, detailed: bool = False, exporter=None):
        """``exporter``: where spans go (tests hand the SDK's in-memory one); default: OTLP to
        ``endpoint``."""
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError:
            raise RuntimeError(MISSING) from None
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter or _exporter(endpoint)))
        self.tracer = self.provider.get_tracer("engine_server")
        self.propagator = TraceContextTextMapPropagator()
        self.detailed = detailed

    def start(self, request, route: str) -> RequestTrace:
        """A request's trace, from now: its arrival."""
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in request.scope["headers"]}
        return RequestTrace(self, self.propagator.extract(headers), route)

    def shutdown(self) -> None:
        self.provider.shutdown()


class RequestTrace:
    def __init__(self, tracing: Tracing, parent, route: str):
        self.tracing, self.parent, self.route = tracing, parent, route
        self.offset = _monotonic_to_epoch_ns()
        self.start = time.monotonic()
        self.submitted: float | None = None
        self.deltas: dict[str, list[tuple[float, int]]] = {}  # request id -> (arrival, tokens) per delta
        self.detokenize = 0.0  # seconds the API spent turning tokens into text
        self.ended = False

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self.offset

    def token_delta(self, request_id: str, count: int) -> None:
        """With --collect-detailed-traces: when each delta of tokens arrived."""
        if self.tracing.detailed:
            self.deltas.setdefault(request_id, []).append((time.monotonic(), count))

    def refused(self, error: BaseException) -> None:
        """The request ended before reaching the engine (a 4xx, say)."""
        self._end(None, error)

    def finished(self, generation) -> None:
        self._end(generation, None)

    def _end(self, generation, error: BaseException | None) -> None:
        if self.ended:
            return
        self.ended = True
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        end = time.monotonic()
        tracer = self.tracing.tracer
        span = tracer.start_span(
            "llm_request", context=self.parent, kind=SpanKind.SERVER, start_time=self._ns(self.start)
        )
        span.set_attribute("http.route", self.route)
        inside = trace.set_span_in_context(span)
        if generation is None or self.submitted is None:
            span.set_status(Status(StatusCode.ERROR, str(getattr(error, "message", error))))
            span.set_attribute("http.response.status_code", getattr(error, "status", 500))
        else:
            self._child(inside, "api.prepare", self.start, self.submitted)
            last = max([self._engine_request(inside, generation, c) for c in generation.choices] or [end])
            self._child(inside, "api.respond", last, end)
            for key, value in _attributes(generation, self.detokenize).items():
                span.set_attribute(key, value)
            if any(c.finish_reason == "error" for c in generation.choices) or generation.refused:
                span.set_status(Status(StatusCode.ERROR, "a sample ended in an error"))
        span.end(self._ns(end))

    def _child(self, context, name: str, start: float, end: float, attributes=None):
        span = self.tracing.tracer.start_span(
            name, context=context, start_time=self._ns(start), attributes=attributes
        )
        span.end(self._ns(max(start, end)))

    def _engine_request(self, context, generation, choice) -> float:
        """The ``engine_request`` span of one sample and its phases; -> when it ended."""
        from opentelemetry import trace

        timer = generation.timers.get(choice.request_id)
        start = self.submitted
        end = timer.last if timer is not None and timer.first_token is not None else time.monotonic()
        span = self.tracing.tracer.start_span(
            "engine_request",
            context=context,
            start_time=self._ns(start),
            attributes={
                "gen_ai.request.id": choice.request_id,
                "gen_ai.usage.completion_tokens": len(choice.token_ids),
                "gen_ai.response.finish_reasons": [str(choice.finish_reason)],
            },
        )
        inside = trace.set_span_in_context(span)
        if timer is not None and timer.first_token is not None:
            queue, prefill = timer.timing or (0.0, timer.first_token - start)
            scheduled = max(start, timer.first_token - prefill)
            self._child(inside, "queue", start, scheduled, {"gen_ai.latency.time_in_queue": queue})
            self._child(inside, "prefill", scheduled, timer.first_token)
            decode = self.tracing.tracer.start_span(
                "decode", context=inside, start_time=self._ns(timer.first_token)
            )
            for at, count in self.deltas.get(choice.request_id, ()):
                decode.add_event("tokens", {"count": count}, timestamp=self._ns(at))
            decode.end(self._ns(end))
        span.end(self._ns(end))
        return end


def _attributes(generation, detokenize: float) -> dict:
    """vLLM's ``gen_ai.*`` attributes of the request span (latencies of its first sample)."""
    body = generation.body
    attributes = {
        "gen_ai.response.model": generation.model_name,  # an adapter's name when one was asked for
        "gen_ai.request.id": generation.id,
        "gen_ai.request.n": body.n,
        "gen_ai.usage.prompt_tokens": sum(len(ids) for _, ids in generation.prompts),
        "gen_ai.usage.completion_tokens": sum(len(c.token_ids) for c in generation.choices),
        "gen_ai.usage.num_sequences": len(generation.choices),
        "engine.detokenize_seconds": detokenize,
    }
    for name, value in (
        ("max_tokens", generation.max_tokens),
        ("temperature", body.temperature),
        ("top_p", body.top_p),
    ):
        if value is not None:
            attributes[f"gen_ai.request.{name}"] = value
    timer = next(iter(generation.timers.values()), None)
    if timer is not None and timer.first_token is not None:
        attributes["gen_ai.latency.time_to_first_token"] = timer.first_token - timer.start
        attributes["gen_ai.latency.e2e"] = timer.last - timer.start
        if timer.timing is not None:
            queue, prefill = timer.timing
            decode = timer.last - timer.first_token
            attributes["gen_ai.latency.time_in_queue"] = queue
            attributes["gen_ai.latency.time_in_model_prefill"] = prefill
            attributes["gen_ai.latency.time_in_model_decode"] = decode
            attributes["gen_ai.latency.time_in_model_inference"] = prefill + decode
    return attributes
