"""The request span without an engine, exported to the SDK's in-memory exporter: the caller's
``traceparent`` is continued, and a request refused before reaching the engine is one span
with an error status naming the refusal."""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.requests import Request

from engine_server.errors import bad_request
from engine_server.tracing import Tracing

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def _request(headers: dict[str, str]) -> Request:
    raw = [(k.encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": raw})


def test_a_refused_request_is_one_error_span_in_the_callers_trace():
    exporter = InMemorySpanExporter()
    tracing = Tracing("m", exporter=exporter)
    trace = tracing.start(_request({"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}), "/v1/completions")
    trace.refused(bad_request("prompt is required", "prompt"))
    trace.refused(bad_request("twice"))  # a trace ends once
    tracing.shutdown()
    (span,) = exporter.get_finished_spans()
    assert span.name == "llm_request" and format(span.context.trace_id, "032x") == TRACE_ID
    assert format(span.parent.span_id, "016x") == PARENT_ID
    assert span.status.status_code.name == "ERROR" and span.status.description == "prompt is required"
    assert span.attributes["http.response.status_code"] == 400
    assert span.attributes["http.route"] == "/v1/completions" and span.end_time >= span.start_time


def test_without_traceparent_the_span_starts_a_trace():
    exporter = InMemorySpanExporter()
    tracing = Tracing("m", exporter=exporter)
    tracing.start(_request({}), "/v1/chat/completions").refused(ValueError("boom"))
    tracing.shutdown()
    (span,) = exporter.get_finished_spans()
    assert span.parent is None and span.attributes["http.response.status_code"] == 500
