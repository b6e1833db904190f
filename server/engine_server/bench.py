"""`engine bench serve`: an open-loop load generator for any OpenAI-compatible server.

Requests arrive at --request-rate per second (gamma-distributed gaps with shape
--burstiness; 1 is a Poisson process, inf sends everything at once), stream their
completions, and are timed client-side: TTFT (first text), TPOT (per output token after
the first), ITL (between chunks) and E2EL. Goodput counts the requests per second that
meet every --goodput SLO.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import numpy as np
from tqdm.auto import tqdm

from engine.cli import Command

_WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
          "government company number group problem fact be have do say get make go know take see come think look "
          "want give use find tell ask seem feel try leave call good new first last long great little own other "
          "old right big high different small large next early young important few public bad same able").split()


class BenchCommand(Command):
    help = "benchmarks (`engine bench serve` drives an OpenAI-compatible server)"

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="bench", required=True)
        serve = sub.add_parser("serve", help="load-test an OpenAI-compatible server")
        serve.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
        serve.add_argument("--model", default=None, help="default: the first of /v1/models")
        serve.add_argument("--endpoint", default="/v1/completions")
        serve.add_argument("--api-key", default=None)
        serve.add_argument("--num-prompts", type=int, default=100)
        serve.add_argument("--request-rate", type=float, default=float("inf"))
        serve.add_argument("--burstiness", type=float, default=1.0)
        serve.add_argument("--input-len", type=int, default=128)
        serve.add_argument("--output-len", type=int, default=128)
        serve.add_argument("--range-ratio", type=float, default=0.0)
        serve.add_argument("--dataset", default="random", help="'random' or a .jsonl file of {\"prompt\": ...}")
        serve.add_argument("--goodput", nargs="*", default=[], metavar="SLO:MS", help="e.g. ttft:500 tpot:50")
        serve.add_argument("--seed", type=int, default=0)
        serve.add_argument("--save-result", default=None)

    def run(self, args) -> int:
        slos = parse_slos(args.goodput)
        result = asyncio.run(benchmark(args, slos))
        print(format_report(result))
        if args.save_result:
            with open(args.save_result, "w") as f:
                json.dump(result, f, indent=2)
        return 0 if result["completed"] else 1


def parse_slos(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        name, _, ms = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not ms:
            raise ValueError(f"--goodput: expected ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        slos[name] = float(ms) / 1000
    return slos


def make_requests(args) -> list[tuple[str, int]]:
    """(prompt, output length) per request."""
    rng = random.Random(args.seed)
    if args.dataset != "random":
        with open(args.dataset) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return [(rows[i % len(rows)]["prompt"], rows[i % len(rows)].get("output_len", args.output_len))
                for i in range(args.num_prompts)]

    def length(n):
        return max(1, int(rng.uniform(n * (1 - args.range_ratio), n * (1 + args.range_ratio))))

    return [(" ".join(rng.choice(_WORDS) for _ in range(length(args.input_len))), length(args.output_len))
            for _ in range(args.num_prompts)]


async def one_request(client: httpx.AsyncClient, url: str, payload: dict, bar) -> dict:
    record = {"ok": False, "ttft": None, "itl": [], "e2el": None, "output_tokens": 0, "prompt_tokens": 0}
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                record["error"] = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            chunks = 0
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    record["error"] = data["error"].get("message")
                    return record
                if data.get("usage"):
                    record["output_tokens"] = data["usage"]["completion_tokens"]
                    record["prompt_tokens"] = data["usage"]["prompt_tokens"]
                text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                               for c in data.get("choices", []))
                if text:
                    now = time.perf_counter()
                    if record["ttft"] is None:
                        record["ttft"] = now - start
                    else:
                        record["itl"].append(now - last)
                    last = now
                    chunks += 1
            record["output_tokens"] = record["output_tokens"] or chunks
            record["e2el"] = time.perf_counter() - start
            record["ok"] = record["ttft"] is not None
    except httpx.HTTPError as exc:
        record["error"] = repr(exc)
    finally:
        bar.update()
    return record


async def benchmark(args, slos: dict[str, float]) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=None,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        requests = make_requests(args)
        rng = np.random.default_rng(args.seed)
        gaps = ([0.0] * len(requests) if args.request_rate == float("inf") else
                rng.gamma(args.burstiness, 1 / (args.request_rate * args.burstiness), len(requests)).tolist())
        tasks = []
        with tqdm(total=len(requests), desc="requests", unit="req") as bar:
            start = time.perf_counter()
            for (prompt, output_len), gap in zip(requests, gaps):
                await asyncio.sleep(gap)
                payload = {"model": model, "prompt": prompt, "max_tokens": output_len, "stream": True,
                           "ignore_eos": True, "temperature": 0.0, "stream_options": {"include_usage": True}}
                tasks.append(asyncio.create_task(one_request(client, args.endpoint, payload, bar)))
            records = await asyncio.gather(*tasks)
            duration = time.perf_counter() - start
    return summarize(records, duration, slos, args, model)


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    v = np.asarray(values) * 1000
    return {"mean": float(v.mean()), "median": float(np.median(v)), "p90": float(np.percentile(v, 90)),
            "p99": float(np.percentile(v, 99))}


def summarize(records: list[dict], duration: float, slos: dict[str, float], args, model: str) -> dict:
    done = [r for r in records if r["ok"]]
    tpot = [(r["e2el"] - r["ttft"]) / (r["output_tokens"] - 1) for r in done if r["output_tokens"] > 1]
    out_tokens = sum(r["output_tokens"] for r in done)
    in_tokens = sum(r["prompt_tokens"] for r in done)

    def meets(r):
        per_token = (r["e2el"] - r["ttft"]) / max(1, r["output_tokens"] - 1)
        return all({"ttft": r["ttft"], "tpot": per_token, "e2el": r["e2el"]}[k] <= v for k, v in slos.items())

    return {
        "model": model, "base_url": args.base_url, "num_prompts": len(records), "request_rate": args.request_rate,
        "burstiness": args.burstiness, "completed": len(done), "failed": len(records) - len(done),
        "errors": sorted({r.get("error") for r in records if not r["ok"]} - {None})[:5],
        "duration_s": duration, "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration, "total_token_throughput": (in_tokens + out_tokens) / duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "goodput": (sum(meets(r) for r in done) / duration) if slos else None,
        "ttft_ms": _stats([r["ttft"] for r in done]), "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in done for x in r["itl"]]), "e2el_ms": _stats([r["e2el"] for r in done]),
    }


def format_report(result: dict) -> str:
    lines = [f"{'model':<28}{result['model']}",
             f"{'requests completed/failed':<28}{result['completed']}/{result['failed']}",
             f"{'duration (s)':<28}{result['duration_s']:.2f}",
             f"{'request throughput (req/s)':<28}{result['request_throughput']:.2f}",
             f"{'output throughput (tok/s)':<28}{result['output_throughput']:.1f}",
             f"{'total throughput (tok/s)':<28}{result['total_token_throughput']:.1f}"]
    if result["goodput"] is not None:
        lines.append(f"{'goodput (req/s)':<28}{result['goodput']:.2f}")
    lines.append(f"{'(ms)':<10}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        s = result[key]
        lines.append(f"{key[:-3].upper():<10}{s['mean']:>10.1f}{s['median']:>10.1f}{s['p90']:>10.1f}{s['p99']:>10.1f}")
    for error in result["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)
