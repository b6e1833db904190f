"""Soak test of `engine serve`: N concurrent streams for a long time against a server this
script starts, checking that nothing fails and nothing leaks.

    python benchmarks/soak.py [--model M] [--concurrency 64] [--duration 1800] [--max-tokens 128]

Most of the N clients stream one completion after another (random prompts from
`engine bench serve`'s generator, EOS ignored, so every request must return exactly its
`max_tokens`); among them (`soak_roles.py`) greedy canaries whose every answer, tokens and
log-probs, must equal their first, clients that hang up after a few frames, and clients that
send malformed requests and must each get a 4xx with an OpenAI-shaped error. Every ~30 s a
progress line reports requests, tokens, errors, the engine's running count and KV usage, and
the resident memory of the API and engine-core processes. At the end the clients finish their
last request, the engine must drop to 0 running requests and 0 KV usage, each process's RSS
must not have grown by more than --max-rss-growth-mib since the first progress sample taken
after every plain stream finished a request (warm-up allocations done), every canary answer
must equal its first (a guarantee the default model gives in default mode and any model gives
under `--batch-invariant`: `/v1/models` says which holds), and the server must exit 0 on
SIGTERM. Exit status 1 on any error or leak. Linux only (RSS from /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import httpx
from health import wait_healthy
from soak_roles import Mix, bad_input, canary, disconnecter

from engine.testing.ports import free_port
from engine_server.bench import one_request
from engine_server.bench.datasets import Tokens, random_requests
from engine_server.bench.metrics import RequestOutput

ENGINE = os.path.join(os.path.dirname(sys.executable), "engine")
MIB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument(
        "--concurrency", type=int, default=64, help="clients in all, the roles below included"
    )
    parser.add_argument("--canaries", type=int, default=4, help="greedy chat canaries among the clients")
    parser.add_argument(
        "--disconnecters", type=int, default=4, help="clients that abandon their streams after a few frames"
    )
    parser.add_argument("--bad-inputs", type=int, default=4, help="clients sending malformed requests")
    parser.add_argument("--duration", type=float, default=1800, help="seconds of load (default 30 min)")
    parser.add_argument("--input-len", type=int, default=64, help="prompt words, varied by ±50%%")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens, varied by ±50%%")
    parser.add_argument("--report-every", type=float, default=30, help="seconds between progress lines")
    parser.add_argument(
        "--max-rss-growth-mib",
        type=float,
        default=64,
        help="allowed RSS growth of each process from the warmed-up sample to the end",
    )
    parser.add_argument(
        "--serve-args",
        default="",
        help="more `engine serve` arguments as one string: --serve-args='--max-num-seqs 64'",
    )
    parser.add_argument("--seed", type=int, default=0, help="of the random prompts")
    args = parser.parse_args(argv)
    if plain_streams(args) < 1:
        parser.error("--concurrency must leave at least one plain stream beside the roles")
    return args


def plain_streams(args) -> int:
    return args.concurrency - args.canaries - args.disconnecters - args.bad_inputs


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / MIB
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Server:
    """A real `engine serve` on a free port, its output in a log file."""

    def __init__(self, args):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log, self.log_path = tempfile.mkstemp(prefix="soak-serve-", suffix=".log")
        command = [
            ENGINE,
            "serve",
            "--port",
            str(self.port),
            *(["--model", args.model] if args.model else []),
            *shlex.split(args.serve_args),
        ]
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        os.close(log)

    def wait_healthy(self, timeout: float = 600) -> None:
        wait_healthy(f"{self.url}/health", self.process, timeout, log_tail=self.log_tail)

    def core_pid(self) -> int:
        with open(f"/proc/{self.process.pid}/task/{self.process.pid}/children") as f:
            return int(f.read().split()[0])

    def log_tail(self, chars: int = 3000) -> str:
        with open(self.log_path) as f:
            return f.read()[-chars:]

    def stop(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                return -9
        return self.process.returncode


def engine_metrics(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        for name in (
            "num_requests_running",
            "num_requests_waiting",
            "kv_cache_usage_perc",
            "generation_tokens_total",
        ):
            if line.startswith(f"vllm:{name}"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values


class Tally:
    """What the workers did."""

    def __init__(self):
        self.requests = self.tokens = 0
        self.errors: list[str] = []

    def record(self, output: RequestOutput, expected_tokens: int) -> None:
        self.requests += 1
        self.tokens += output.output_tokens
        if not output.success:
            self.errors.append(output.error or "no output")
        elif output.output_tokens != expected_tokens:
            self.errors.append(f"{output.output_tokens} tokens instead of {expected_tokens}")


async def worker(
    client: httpx.AsyncClient, model: str, pool: list, offset: int, step: int, tally: Tally, deadline: float
) -> None:
    i = offset
    while time.monotonic() < deadline:
        request = pool[i % len(pool)]
        body = {
            "model": model,
            "prompt": request.prompt,
            "max_tokens": request.output_len,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        tally.record(
            await one_request(client, "/v1/completions", body, request.prompt_len), request.output_len
        )
        i += step


class Sampler:
    """Periodic progress lines and the RSS samples they carry."""

    def __init__(self, server: Server, client: httpx.AsyncClient, tally: Tally):
        self.server, self.client, self.tally = server, client, tally
        self.api_pid, self.core_pid = server.process.pid, server.core_pid()
        self.start = time.monotonic()
        self.samples: list[
            tuple[float, int, float, float]
        ] = []  # (seconds, requests done, API MiB, core MiB)
        self._last = (self.start, 0)

    def rss(self) -> tuple[float, float]:
        return rss_mib(self.api_pid), rss_mib(self.core_pid)

    async def sample(self) -> None:
        now = time.monotonic()
        api, core = self.rss()
        self.samples.append((now - self.start, self.tally.requests, api, core))
        engine = engine_metrics((await self.client.get("/metrics")).text)
        generated = engine.pop("generation_tokens_total", 0)
        then, before = self._last
        rate = (generated - before) / max(now - then, 1e-9)
        self._last = (now, generated)
        minutes, seconds = divmod(int(now - self.start), 60)
        print(
            f"[{minutes:3d}:{seconds:02d}] {self.tally.requests} requests done, {self.tally.tokens} tokens "
            f"(server: {rate:.0f} tok/s), {len(self.tally.errors)} errors"
            f" | running {engine.get('num_requests_running', 0):.0f}"
            f" waiting {engine.get('num_requests_waiting', 0):.0f}"
            f" KV {engine.get('kv_cache_usage_perc', 0):.0%}"
            f" | RSS API {api:.0f} MiB, core {core:.0f} MiB",
            flush=True,
        )

    async def run(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            await self.sample()


async def wait_idle(client: httpx.AsyncClient, timeout: float = 30) -> dict[str, float]:
    """The engine's gauges once running, waiting and KV usage are all 0 (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        engine = engine_metrics((await client.get("/metrics")).text)
        engine.pop("generation_tokens_total", None)
        if not any(engine.values()) or time.monotonic() > deadline:
            return engine
        await asyncio.sleep(0.25)


async def soak(args, server: Server) -> list[str]:
    """Runs the load; returns the failures (empty: passed)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        lengths = argparse.Namespace(
            seed=args.seed,
            num_prompts=4 * args.concurrency,
            random_input_len=args.input_len,
            random_output_len=args.max_tokens,
            random_range_ratio=0.5,
            random_prefix_len=0,
        )
        pool = await random_requests(Tokens(client, model), lengths, as_text=False)
        tally = Tally()
        sampler = Sampler(server, client, tally)
        await sampler.sample()
        deadline = time.monotonic() + args.duration
        sampling = asyncio.create_task(sampler.run(args.report_every))
        streams = plain_streams(args)
        mix = Mix()
        await asyncio.gather(
            *(worker(client, model, pool, i, streams, tally, deadline) for i in range(streams)),
            *(canary(client, model, i, mix, deadline) for i in range(args.canaries)),
            *(disconnecter(client, model, args.max_tokens, mix, deadline) for _ in range(args.disconnecters)),
            *(bad_input(client, model, i, mix, deadline) for i in range(args.bad_inputs)),
        )
        sampling.cancel()
        engine = await wait_idle(client)
        await sampler.sample()
    print(mix.summary())
    return mix.failures() + verdict(args, tally, engine, sampler.samples)


def verdict(args, tally: Tally, engine: dict[str, float], samples: list) -> list[str]:
    failures = (
        [f"{len(tally.errors)} request errors, e.g. {sorted(set(tally.errors))[:3]}"] if tally.errors else []
    )
    if any(engine.values()):
        failures.append(f"engine not idle after the load: {engine}")
    # warmed up: every worker has finished a request, so every batch shape has been seen
    baseline = next((s for s in samples[:-1] if s[1] >= plain_streams(args)), samples[0])
    end = samples[-1]
    print(
        f"RSS (MiB)       API    core\n  start    {samples[0][2]:8.0f}{samples[0][3]:8.0f}\n"
        f"  baseline {baseline[2]:8.0f}{baseline[3]:8.0f}   (at {baseline[0]:.0f} s, warmed up)\n"
        f"  end      {end[2]:8.0f}{end[3]:8.0f}   (at {end[0]:.0f} s)"
    )
    for name, column in (("API", 2), ("core", 3)):
        growth = end[column] - baseline[column]
        if growth > args.max_rss_growth_mib:
            failures.append(f"{name} RSS grew {growth:.0f} MiB (over {args.max_rss_growth_mib:g})")
    print(
        f"{tally.requests} requests, {tally.tokens} tokens, {len(tally.errors)} errors; engine after the "
        f"load: running {engine.get('num_requests_running', 0):.0f}, waiting "
        f"{engine.get('num_requests_waiting', 0):.0f}, KV {engine.get('kv_cache_usage_perc', 0):.1%}"
    )
    return failures


def main(argv=None) -> int:
    args = parse_args(argv)
    server = Server(args)
    try:
        server.wait_healthy()
        failures = asyncio.run(soak(args, server))
    except (OSError, RuntimeError, httpx.HTTPError) as exc:  # the server died or stopped answering
        failures = [f"soak aborted: {exc!r}"]
    finally:
        code = server.stop()
    if code != 0:
        failures.append(f"engine serve exited with {code} on SIGTERM")
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    if failures:
        print(f"server log ({server.log_path}):\n{server.log_tail()}", file=sys.stderr)
        return 1
    os.unlink(server.log_path)
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
