"""From timed requests to the result: the keys and the report layout of `vllm bench serve`,
so saved results of both tools compare field by field."""

from __future__ import annotations

import math

import attrs
import numpy as np


@attrs.define
class RequestOutput:
    """One request, timed on the client (seconds, ``time.perf_counter``)."""

    prompt_len: int
    success: bool = False
    start_time: float = 0.0
    ttft: float = 0.0
    itl: list[float] = attrs.Factory(list)  # gaps between chunks after the first
    latency: float = 0.0
    output_tokens: int = 0
    generated_text: str = ""
    error: str = ""


def parse_slos(items: list[str]) -> dict[str, float]:
    """``ttft:MS tpot:MS e2el:MS`` → seconds per name."""
    slos = {}
    for item in items:
        name, _, ms = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not ms:
            raise ValueError(f"--goodput: expected ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        slos[name] = float(ms) / 1000
    return slos


def _tpot(output: RequestOutput) -> float | None:
    if output.output_tokens < 2:
        return None
    return (output.latency - output.ttft) / (output.output_tokens - 1)


def _meets(output: RequestOutput, slos: dict[str, float]) -> bool:
    values = {"ttft": output.ttft, "tpot": _tpot(output) or 0.0, "e2el": output.latency}
    return all(values[name] <= limit for name, limit in slos.items())


def _peaks(done: list[RequestOutput]) -> tuple[float, int]:
    """The highest output tokens in any one-second bucket, and the most requests in flight."""
    if not done:
        return 0.0, 0
    origin = min(o.start_time for o in done)
    buckets: dict[int, int] = {}
    for o in done:
        t = o.start_time + o.ttft
        times = [t]
        for gap in o.itl:
            t += gap
            times.append(t)
        per_chunk = o.output_tokens / len(times)
        for t in times:
            second = int(t - origin)
            buckets[second] = buckets.get(second, 0) + per_chunk
    events = sorted([(o.start_time, 1) for o in done] + [(o.start_time + o.latency, -1) for o in done])
    in_flight = peak = 0
    for _, change in events:
        in_flight += change
        peak = max(peak, in_flight)
    return float(max(buckets.values())), peak


def summarize(
    outputs: list[RequestOutput],
    duration: float,
    slos: dict[str, float],
    percentile_metrics: list[str],
    percentiles: list[float],
) -> dict:
    done = [o for o in outputs if o.success]
    total_input = sum(o.prompt_len for o in done)
    total_output = sum(o.output_tokens for o in done)
    peak_tokens, peak_requests = _peaks(done)
    result = {
        "duration": duration,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
        "request_goodput": sum(_meets(o, slos) for o in done) / duration if slos else None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [o.output_tokens for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_requests,
    }
    series = {
        "ttft": [o.ttft for o in done],
        "tpot": [t for o in done if (t := _tpot(o)) is not None],
        "itl": [gap for o in done for gap in o.itl],
        "e2el": [o.latency for o in done],
    }
    for name in percentile_metrics:
        values = np.asarray(series[name] or [0.0]) * 1000
        result[f"mean_{name}_ms"] = float(values.mean())
        result[f"median_{name}_ms"] = float(np.median(values))
        result[f"std_{name}_ms"] = float(values.std())
        for p in percentiles:
            result[f"p{_percent_word(p)}_{name}_ms"] = float(np.percentile(values, p))
    return result


def _percent_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def format_report(result: dict, percentile_metrics: list[str], percentiles: list[float]) -> str:
    def row(label, value, fmt="{:<10}"):
        return f"{label:<40} " + fmt.format(value)

    lines = [
        "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
        row("Successful requests:", result["completed"]),
        row("Failed requests:", result["failed"]),
    ]
    if result.get("max_concurrency") is not None:
        lines.append(row("Maximum request concurrency:", result["max_concurrency"]))
    if not math.isinf(result.get("request_rate", math.inf)):
        lines.append(row("Request rate configured (RPS):", result["request_rate"], "{:<10.2f}"))
    lines += [
        row("Benchmark duration (s):", result["duration"], "{:<10.2f}"),
        row("Total input tokens:", result["total_input_tokens"]),
        row("Total generated tokens:", result["total_output_tokens"]),
        row("Request throughput (req/s):", result["request_throughput"], "{:<10.2f}"),
    ]
    if result["request_goodput"] is not None:
        lines.append(row("Request goodput (req/s):", result["request_goodput"], "{:<10.2f}"))
    lines += [
        row("Output token throughput (tok/s):", result["output_throughput"], "{:<10.2f}"),
        row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], "{:<10.2f}"),
        row("Peak concurrent requests:", result["max_concurrent_requests"]),
        row("Total token throughput (tok/s):", result["total_token_throughput"], "{:<10.2f}"),
    ]
    for name in percentile_metrics:
        short, header = _HEADERS[name]
        lines += [
            "{s:{c}^{n}}".format(s=header, n=50, c="-"),
            row(f"Mean {short} (ms):", result[f"mean_{name}_ms"], "{:<10.2f}"),
            row(f"Median {short} (ms):", result[f"median_{name}_ms"], "{:<10.2f}"),
        ]
        lines += [
            row(f"P{_percent_word(p)} {short} (ms):", result[f"p{_percent_word(p)}_{name}_ms"], "{:<10.2f}")
            for p in percentiles
        ]
    lines.append("=" * 50)
    errors = sorted({e for e in result["errors"] if e})
    lines += [f"error: {e}" for e in errors[:5]]
    return "\n".join(lines)
