"""tessellm-server pieces that need no running server: the wire protocol and the benchmark's
arithmetic."""

from __future__ import annotations

import argparse

import pytest

from engine import GrammarSpec, SamplingParams
from engine_server import bench, protocol


def test_messages_round_trip_without_pickle():
    params = SamplingParams(temperature=0.5, stop=["x"], seed=3, structured_outputs=GrammarSpec("choice", ["a"]))
    add = protocol.AddRequest("r1", [1, 2, 3], params.to_dict(), priority=2, cache_salt="s")
    decoded = protocol.decode_to_core(protocol.encode(add))
    assert protocol.encode(decoded) == protocol.encode(add) and SamplingParams.from_dict(decoded.params) == params
    out = protocol.Outputs([protocol.Delta("r1", [5], [([5, 6], [-0.1, -2.0], [1, 2])], None, "stop", 7)],
                           {"running": 1.0})
    assert protocol.decode_from_core(protocol.encode(out)) == out
    with pytest.raises(Exception):
        protocol.decode_to_core(b"\x80\x04not msgpack")


def test_slo_parsing_and_summary():
    assert bench.parse_slos(["ttft:500", "tpot:50"]) == {"ttft": 0.5, "tpot": 0.05}
    with pytest.raises(ValueError, match="--goodput"):
        bench.parse_slos(["latency:5"])
    records = [{"ok": True, "ttft": 0.1, "itl": [0.01, 0.02], "e2el": 0.13, "output_tokens": 3, "prompt_tokens": 4},
               {"ok": True, "ttft": 0.9, "itl": [0.05], "e2el": 1.0, "output_tokens": 2, "prompt_tokens": 4},
               {"ok": False, "ttft": None, "itl": [], "e2el": None, "output_tokens": 0, "prompt_tokens": 0,
                "error": "HTTP 400"}]
    args = argparse.Namespace(base_url="u", request_rate=2.0, burstiness=1.0)
    result = bench.summarize(records, 2.0, {"ttft": 0.5}, args, "m")
    assert result["completed"] == 2 and result["failed"] == 1 and result["errors"] == ["HTTP 400"]
    assert result["goodput"] == 0.5 and result["output_throughput"] == 2.5
    assert result["ttft_ms"]["mean"] == pytest.approx(500.0)
    assert result["tpot_ms"]["median"] == pytest.approx((15 + 100) / 2)
    assert "goodput" in bench.format_report(result)
