"""Request tracing: a real `engine serve --otlp-traces-endpoint` exporting to a real OTLP/HTTP
receiver (protobuf decoded with OpenTelemetry's own message classes). Each request's
``llm_request`` span continues the caller's ``traceparent``, its children tile ≥ 95% of its
wall time, and it carries vLLM's ``gen_ai.*`` attributes; a refused request's span says so."""

from __future__ import annotations

import http.server
import os
import threading
import time

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from engine.testing.ports import free_port
from tests.serving import serve

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Receiver(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: every span POSTed to /v1/traces, decoded."""

    def __init__(self, port: int):
        self.spans: list = []
        super().__init__(("127.0.0.1", port), _Handler)

    def wait_for(self, predicate, timeout: float = 20):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [s for s in list(self.spans) if predicate(s)]
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError("no such span arrived")


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest.FromString(body)
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                self.server.spans.extend(scope.spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def receiver():
    server = Receiver(free_port())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def server(tiny_llama, receiver):
    args = ("--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "512")
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}/v1/traces"
    env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "50"}  # export within 50 ms, not 5 s
    with serve(
        tiny_llama[0], *args, "--otlp-traces-endpoint", endpoint, "--collect-detailed-traces", "all", env=env
    ) as s:
        yield s


def attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


def children(receiver, span) -> list:
    return [s for s in receiver.spans if s.parent_span_id == span.span_id and s.trace_id == span.trace_id]


def coverage(span, parts) -> float:
    """The share of ``span``'s wall time that the union of ``parts`` covers."""
    covered, reach = 0, span.start_time_unix_nano
    for part in sorted(parts, key=lambda p: p.start_time_unix_nano):
        start, end = (
            max(part.start_time_unix_nano, reach),
            min(part.end_time_unix_nano, span.end_time_unix_nano),
        )
        if end > start:
            covered += end - start
            reach = end
    return covered / (span.end_time_unix_nano - span.start_time_unix_nano)


def request_span(receiver, request_id: str):
    (span,) = receiver.wait_for(
        lambda s: s.name == "llm_request" and attributes(s).get("gen_ai.request.id") == request_id
    )
    return span


def test_streamed_chat_continues_the_callers_trace_and_its_phases_tile_it(server, receiver):
    client = server.openai()
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
    )
    chunks = list(stream)
    span = request_span(receiver, chunks[0].id)
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    facts = attributes(span)
    assert facts["gen_ai.response.model"] == "tiny" and facts["http.route"] == "/v1/chat/completions"
    assert facts["gen_ai.usage.prompt_tokens"] == chunks[-1].usage.prompt_tokens
    assert facts["gen_ai.usage.completion_tokens"] == chunks[-1].usage.completion_tokens
    assert facts["gen_ai.request.max_tokens"] == 24 and facts["gen_ai.request.temperature"] == 0
    assert 0 < facts["gen_ai.latency.time_to_first_token"] <= facts["gen_ai.latency.e2e"]
    assert facts["gen_ai.latency.time_in_queue"] >= 0 and facts["gen_ai.latency.time_in_model_prefill"] > 0
    parts = children(receiver, span)
    assert sorted(p.name for p in parts) == ["api.prepare", "api.respond", "engine_request"]
    assert coverage(span, parts) >= 0.95
    (engine,) = [p for p in parts if p.name == "engine_request"]
    phases = {p.name: p for p in children(receiver, engine)}
    assert set(phases) == {"queue", "prefill", "decode"} and coverage(engine, phases.values()) >= 0.95
    deltas = [e for e in phases["decode"].events if e.name == "tokens"]  # --collect-detailed-traces
    assert sum(attributes(e)["count"] for e in deltas) == facts["gen_ai.usage.completion_tokens"]


def test_completion_with_two_samples_has_an_engine_span_each(server, receiver):
    response = server.openai().completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=8, n=2, temperature=1, seed=3
    )
    span = request_span(receiver, response.id)
    parts = children(receiver, span)
    engines = [p for p in parts if p.name == "engine_request"]
    assert len(engines) == 2 and coverage(span, parts) >= 0.95
    assert (
        sum(attributes(e)["gen_ai.usage.completion_tokens"] for e in engines)
        == response.usage.completion_tokens
    )


def test_a_responses_request_is_traced_as_chat_is(server, receiver):
    response = server.openai().responses.create(model="tiny", input="Hi", max_output_tokens=4, temperature=0)
    span = request_span(receiver, response.id)
    facts = attributes(span)
    assert facts["http.route"] == "/v1/responses"
    assert facts["gen_ai.usage.completion_tokens"] == response.usage.output_tokens
    assert sorted(p.name for p in children(receiver, span)) == [
        "api.prepare",
        "api.respond",
        "engine_request",
    ]


def test_a_refused_request_has_an_error_span(server, receiver):
    started = time.time_ns()
    refused = httpx.post(
        f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": []}, headers=server.headers
    )
    assert refused.status_code == 400
    (span,) = receiver.wait_for(
        lambda s: s.name == "llm_request" and s.start_time_unix_nano >= started and s.status.code == 2
    )
    assert attributes(span)["http.response.status_code"] == 400 and span.status.message
