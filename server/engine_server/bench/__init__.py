"""`engine bench serve`: a load generator for any OpenAI-compatible server, with the flags,
the report and the saved JSON keys of `vllm bench serve`.

Requests arrive at ``--request-rate`` per second (gamma-distributed gaps with shape
``--burstiness``; 1 is a Poisson process; ``inf`` sends everything at once), at most
``--max-concurrency`` at a time, stream their output from ``/v1/completions`` or
``/v1/chat/completions``, and are timed on the client: TTFT, TPOT (per output token after
the first), ITL (between chunks) and E2EL; goodput counts requests per second that meet
every ``--goodput`` SLO.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import time
from datetime import datetime

import httpx
import numpy as np
from tqdm.auto import tqdm

from engine.entrypoints.cli import Command
from engine_server.bench.datasets import LocalTokens, SampleRequest, Tokens, sample_requests
from engine_server.bench.metrics import RequestOutput, format_report, parse_slos, summarize

_CHAT_BACKENDS = ("openai-chat",)


class BenchCommand(Command):
    help = "benchmarks (`engine bench serve` drives an OpenAI-compatible server)"

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="bench", required=True)
        add_serve_arguments(sub.add_parser("serve", help="load-test an OpenAI-compatible server"))

    def run(self, args) -> int:
        resolve_arguments(args)
        result = asyncio.run(benchmark(args))
        print(format_report(result, args.percentile_metrics, args.metric_percentiles))
        if args.save_result:
            path = result_path(args, result)
            with open(path, "w") as f:
                json.dump(result, f, indent=2)
            print(f"saved {path}")
        return 0 if result["completed"] else 1


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    target = p.add_argument_group("server")
    target.add_argument(
        "--backend",
        default="openai",
        choices=("openai", "vllm", "openai-chat"),
        help="openai/vllm: /v1/completions with `prompt`; openai-chat: /v1/chat/completions "
        "with `messages` (default: from --endpoint)",
    )
    target.add_argument(
        "--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000 (default: http://HOST:PORT)"
    )
    target.add_argument("--host", default="127.0.0.1")
    target.add_argument("--port", type=int, default=8000)
    target.add_argument(
        "--endpoint", default=None, help="/v1/completions or /v1/chat/completions (default: the backend's)"
    )
    target.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    target.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME",
        help="adapter names the server serves: each request names one of them at random, "
        "seeded by --seed (default: every request names --model)",
    )
    target.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as `Authorization: Bearer KEY` (default: $OPENAI_API_KEY)",
    )
    data = p.add_argument_group("dataset")
    data.add_argument(
        "--dataset-name",
        default="random",
        choices=("random", "sharegpt", "custom"),
        help="random: token-exact prompts; sharegpt: a ShareGPT JSON file; custom: JSON lines "
        'of {"prompt": ..., "output_len": ...}',
    )
    data.add_argument("--dataset-path", default=None, help="the file for sharegpt and custom")
    data.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer folder to count prompt tokens with (default: the server's, over /tokenize)",
    )
    data.add_argument("--num-prompts", type=int, default=1000, help="requests to send (default: 1000)")
    data.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens (default: 1024)")
    data.add_argument("--random-output-len", type=int, default=128, help="output tokens (default: 128)")
    data.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [L·(1−r), L·(1+r)] (default: 0, exact)",
    )
    data.add_argument(
        "--random-prefix-len", type=int, default=0, help="tokens of a prefix shared by all prompts"
    )
    data.add_argument("--input-len", type=int, default=None, help="alias of --random-input-len")
    data.add_argument("--output-len", type=int, default=None, help="alias of --random-output-len")
    data.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="output tokens for every ShareGPT request (default: the reply's length)",
    )
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (default: inf)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 is Poisson")
    load.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    load.add_argument("--num-warmups", type=int, default=0, help="untimed requests first")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length")
    load.add_argument("--temperature", type=float, default=0.0, help="(default: 0, greedy)")
    load.add_argument("--top-p", type=float, default=None)
    load.add_argument("--top-k", type=int, default=None)
    load.add_argument("--disable-tqdm", action="store_true")
    out = p.add_argument_group("results")
    out.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl,e2el",
        help="comma-separated of ttft, tpot, itl, e2el (default: all)",
    )
    out.add_argument(
        "--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99 (default: 99)"
    )
    out.add_argument("--goodput", nargs="*", default=[], metavar="SLO:MS", help="e.g. ttft:500 tpot:50")
    out.add_argument(
        "--save-result",
        nargs="?",
        const=True,
        default=None,
        help="save the result JSON (to PATH if given, else a name built like vLLM's)",
    )
    out.add_argument("--result-dir", default=None)
    out.add_argument("--result-filename", default=None)
    out.add_argument("--label", default=None, help="prefix of the result file name (default: the backend)")
    out.add_argument(
        "--metadata", nargs="*", default=[], metavar="KEY=VALUE", help="added to the result JSON"
    )


def resolve_arguments(args) -> None:
    """Fill the defaults that depend on other flags, and check them."""
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    if args.endpoint is None:
        args.endpoint = "/v1/chat/completions" if args.backend in _CHAT_BACKENDS else "/v1/completions"
    args.chat = args.backend in _CHAT_BACKENDS or args.endpoint.endswith("/chat/completions")
    args.random_input_len = args.input_len or args.random_input_len
    args.random_output_len = args.output_len or args.random_output_len
    args.percentile_metrics = [m for m in args.percentile_metrics.split(",") if m]
    if unknown := set(args.percentile_metrics) - {"ttft", "tpot", "itl", "e2el"}:
        raise ValueError(f"--percentile-metrics: unknown {', '.join(sorted(unknown))}")
    args.metric_percentiles = [float(p) for p in args.metric_percentiles.split(",") if p]
    args.slos = parse_slos(args.goodput)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")


def request_models(args, model: str, count: int) -> list[str]:
    """The model each request names: ``model``, or with ``--lora-modules`` one adapter of them
    at random per request, as ``vllm bench serve`` picks them."""
    if not args.lora_modules:
        return [model] * count
    rng = random.Random(args.seed)
    return [rng.choice(args.lora_modules) for _ in range(count)]


def request_body(args, model: str, request: SampleRequest) -> dict:
    body = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": args.temperature,
        "ignore_eos": args.ignore_eos,
    }
    body.update({k: v for k, v in (("top_p", args.top_p), ("top_k", args.top_k)) if v is not None})
    if args.chat:  # chat prompts are always text (sample_requests)
        body.update(
            messages=[{"role": "user", "content": request.prompt}], max_completion_tokens=request.output_len
        )
    else:
        body.update(prompt=request.prompt, max_tokens=request.output_len)
    return body


async def one_request(client: httpx.AsyncClient, endpoint: str, body: dict, prompt_len: int) -> RequestOutput:
    output = RequestOutput(prompt_len)
    output.start_time = last = time.perf_counter()
    text, chunks = [], 0
    try:
        async with client.stream("POST", endpoint, json=body) as response:
            if response.status_code != 200:
                output.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return output
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    output.error = str(data["error"].get("message"))
                    return output
                if usage := data.get("usage"):
                    output.output_tokens = usage["completion_tokens"]
                    output.prompt_len = usage.get("prompt_tokens") or prompt_len
                piece = "".join(
                    c.get("text") or (c.get("delta") or {}).get("content") or ""
                    for c in data.get("choices", [])
                )
                if piece:
                    now = time.perf_counter()
                    if chunks == 0:
                        output.ttft = now - output.start_time
                    else:
                        output.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    text.append(piece)
        output.latency = time.perf_counter() - output.start_time
        output.output_tokens = output.output_tokens or chunks
        output.generated_text = "".join(text)
        output.success = chunks > 0
        if not output.success:
            output.error = "no output"
    except httpx.HTTPError as exc:
        output.error = repr(exc)
    return output


def arrival_gaps(args, count: int) -> list[float]:
    if args.request_rate == float("inf"):
        return [0.0] * count
    rng = np.random.default_rng(args.seed)
    return rng.gamma(args.burstiness, 1 / (args.request_rate * args.burstiness), count).tolist()


async def benchmark(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(
        max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency
    )
    async with httpx.AsyncClient(
        base_url=args.base_url, headers=headers, timeout=None, limits=limits
    ) as client:
        models = await client.get("/v1/models")
        models.raise_for_status()
        model = args.model or models.json()["data"][0]["id"]
        tokens = LocalTokens(args.tokenizer) if args.tokenizer else Tokens(client, model)
        requests = await sample_requests(tokens, args, args.chat)
        for _ in range(args.num_warmups):
            await one_request(
                client, args.endpoint, request_body(args, model, requests[0]), requests[0].prompt_len
            )
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()
        bar = tqdm(total=len(requests), desc="requests", unit="req", disable=args.disable_tqdm)

        async def limited(request: SampleRequest, name: str) -> RequestOutput:
            async with gate:
                output = await one_request(
                    client, args.endpoint, request_body(args, name, request), request.prompt_len
                )
            bar.update()
            return output

        tasks = []
        start = time.perf_counter()
        names = request_models(args, model, len(requests))
        for request, name, gap in zip(requests, names, arrival_gaps(args, len(requests))):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(request, name)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": args.backend,
        "label": args.label,
        "model_id": model,
        "num_prompts": len(requests),
        "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
    }
    result.update(dict(item.split("=", 1) for item in args.metadata))
    result.update(summarize(outputs, duration, args.slos, args.percentile_metrics, args.metric_percentiles))
    return result


def result_path(args, result: dict) -> str:
    if isinstance(args.save_result, str):
        return args.save_result
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    name = args.result_filename or (
        f"{args.label or args.backend}-{args.request_rate}qps{concurrency}-"
        f"{result['model_id'].split('/')[-1]}-{result['date']}.json"
    )
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name
