"""tessellm-server pieces that need no running server: the wire protocol and the benchmark's
arithmetic."""

from __future__ import annotations

import msgspec
import pytest

from engine import GrammarSpec, PoolingParams, SamplingParams
from engine.client import protocol
from engine.messages.stats import EngineStats, TokensPerStep
from engine_server.bench import metrics


def test_messages_round_trip_without_pickle():
    params = SamplingParams(
        temperature=0.5, stop=["x"], seed=3, structured_outputs=GrammarSpec("choice", ["a"])
    )
    add = protocol.AddRequest("r1", [1, 2, 3], params.to_dict(), priority=2, cache_salt="s")
    decoded = protocol.decode_to_core(protocol.encode(add))
    assert (
        protocol.encode(decoded) == protocol.encode(add)
        and SamplingParams.from_dict(decoded.params) == params
    )
    pooled = protocol.AddRequest(
        "r2", [4], PoolingParams(normalize=False, dimensions=8).to_dict(), pooling=True
    )
    batch = protocol.decode_to_core(protocol.encode(protocol.AddBatch([add, pooled])))
    assert [protocol.encode(r) for r in batch.requests] == [protocol.encode(add), protocol.encode(pooled)]
    assert PoolingParams.from_dict(batch.requests[1].params) == PoolingParams(normalize=False, dimensions=8)
    out = protocol.Outputs(
        [
            protocol.Delta("r1", [5], [([5, 6], [-0.1, -2.0], [1, 2])], None, "stop", 7),
            protocol.Delta("r2", [], finish_reason="stop", embedding=b"\x00\x00\x80?"),
        ],
        EngineStats(
            running=1,
            spec_accepted_per_pos=(3, 1),
            tokens_per_step=TokensPerStep((("1", 2), ("+Inf", 5)), 40),
        ),
    )
    assert protocol.decode_from_core(protocol.encode(out)) == out
    with pytest.raises(msgspec.DecodeError):
        protocol.decode_to_core(b"\x80\x04not msgpack")


def test_slo_parsing_and_summary():
    assert metrics.parse_slos(["ttft:500", "tpot:50"]) == {"ttft": 0.5, "tpot": 0.05}
    with pytest.raises(ValueError, match="--goodput"):
        metrics.parse_slos(["latency:5"])
    outputs = [
        metrics.RequestOutput(4, True, 0.0, 0.1, [0.01, 0.02], 0.13, 3),
        metrics.RequestOutput(4, True, 0.05, 0.9, [0.05], 1.0, 2),
        metrics.RequestOutput(4, error="HTTP 400"),
    ]
    result = metrics.summarize(outputs, 2.0, {"ttft": 0.5}, ["ttft", "tpot", "itl", "e2el"], [50.0, 99.0])
    assert result["completed"] == 2 and result["failed"] == 1 and result["errors"] == ["", "", "HTTP 400"]
    assert result["request_goodput"] == 0.5 and result["output_throughput"] == 2.5
    assert result["mean_ttft_ms"] == pytest.approx(500.0) and result["p50_ttft_ms"] == pytest.approx(500.0)
    assert result["median_tpot_ms"] == pytest.approx((15 + 100) / 2)
    assert (
        result["max_concurrent_requests"] == 2 and result["max_output_tokens_per_s"] == 4
    )  # 3 + 1 tokens within the first second
    report = metrics.format_report(result, ["ttft", "tpot", "itl", "e2el"], [50.0, 99.0])
    assert "Request goodput (req/s):" in report and "P99 ITL (ms):" in report and "error: HTTP 400" in report
