"""`engine bench serve` against a real server: open-loop arrivals, streaming, the report and
the saved JSON."""

from __future__ import annotations

import json
import subprocess

from tests.serving import ENGINE, serve


def test_bench_serve_reports_and_saves(tiny_llama, tmp_path):
    args = ("--dtype", "float32", "--num-blocks", "128", "--max-model-len", "512")
    with serve(tiny_llama[0], *args, api_key="k") as server:
        out = tmp_path / "result.json"
        result = subprocess.run([ENGINE, "bench", "serve", "--base-url", server.url, "--api-key", "k",
                                 "--num-prompts", "12", "--request-rate", "30", "--burstiness", "0.5",
                                 "--input-len", "20", "--output-len", "10", "--range-ratio", "0.5",
                                 "--goodput", "ttft:5000", "tpot:1000", "--save-result", str(out)],
                                capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "output throughput" in result.stdout and "TTFT" in result.stdout
    saved = json.loads(out.read_text())
    assert saved["completed"] == 12 and saved["failed"] == 0
    assert saved["goodput"] > 0 and saved["output_throughput"] > 0
    assert 5 * 12 <= saved["total_output_tokens"] <= 15 * 12
    assert saved["ttft_ms"]["p99"] >= saved["ttft_ms"]["median"] > 0
