"""``lora.py --online``: its configs behind ``engine serve``, one server per config, all started
at once, and driven in turn round after round by ``engine bench serve`` (random prompts of
``--prompt-len`` tokens, ``--output-len`` tokens each, EOS ignored, all ``--num-prompts`` sent at
once). ``lora1`` names ``adapter-0`` in every request; ``lora4`` and ``lora16`` name one of their
adapters at random per request (the client's ``--lora-modules``, seeded, so every round sends
the same mix). A round's rate is the client's output tok/s, and by CPU time the output tokens over
the CPU seconds the server's processes used during the run (with one engine thread, the work
done). Before the rounds every server has served one untimed run and gone idle (its CPU time
still for two seconds): a server records its decode tapes while idle after it answers
``/health``, and a round must not time a server that is still recording.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager

import psutil
from health import wait_healthy

from engine.testing.ports import free_port

ENGINE = os.path.join(os.path.dirname(sys.executable), "engine")


def server_flags(adapters: int, max_loras: int | None, paths: list[str], rank: int) -> list[str]:
    """The LoRA flags of one config's server (none for the base model)."""
    if max_loras is None:
        return []
    modules = [f"adapter-{i}={path}" for i, path in enumerate(paths[: max(adapters, 1)])]
    return [
        "--enable-lora",
        "--max-loras",
        str(max_loras),
        "--max-lora-rank",
        str(rank),
        "--max-cpu-loras",
        "16",
        "--lora-modules",
        *modules,
    ]


@contextmanager
def running_server(flags: list[str], tokens: int, prompts: int, enforce_eager: bool):
    """A started ``engine serve`` with ``flags``, once it answers ``/health``: (its process, its URL)."""
    port = free_port()
    blocks = prompts * -(-tokens // 16) + 16
    command = [ENGINE, "serve", "--port", str(port), "--seed", "0", "--max-model-len", str(tokens)]
    command += ["--block-size", "16", "--num-blocks", str(blocks), *flags]
    command += ["--enforce-eager"] if enforce_eager else []
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(f"{url}/health", server, 600, poll=1, log_tail=lambda: _tail(log))
            yield server, url
        finally:
            os.killpg(server.pid, 15)
            server.wait(120)


def _tail(log) -> str:
    log.seek(0)
    return log.read()[-3000:]


def wait_idle(process: psutil.Process, timeout: float = 600) -> None:
    """Return once ``process`` and its children use under 0.05 s of CPU in two seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = cpu_seconds(process)
        time.sleep(2)
        if cpu_seconds(process) - before < 0.05:
            return
    raise RuntimeError(f"the server was still busy after {timeout:g} s")


def cpu_seconds(process: psutil.Process) -> float:
    """User + system seconds of ``process`` and its children so far."""
    total = 0.0
    for p in [process, *process.children(recursive=True)]:
        try:
            times = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def drive(url: str, server: psutil.Process, args, adapters: int, prompts: int) -> tuple[float, float]:
    """One ``engine bench serve`` run of ``prompts`` requests: output tok/s by the wall clock
    (the client's) and by the server's CPU time."""
    names = ["--lora-modules", *(f"adapter-{i}" for i in range(adapters))] if adapters else []
    with tempfile.TemporaryDirectory() as scratch:
        result = os.path.join(scratch, "result.json")
        command = [ENGINE, "bench", "serve", "--base-url", url, "--dataset-name", "random"]
        command += ["--random-input-len", str(args.prompt_len), "--random-output-len", str(args.output_len)]
        command += ["--num-prompts", str(prompts), "--ignore-eos", "--seed", "0", "--disable-tqdm"]
        command += ["--save-result", result, *names]
        before = cpu_seconds(server)
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        cpu = cpu_seconds(server) - before
        if done.returncode:
            raise RuntimeError(f"engine bench serve failed: {done.stdout[-1000:]}{done.stderr[-2000:]}")
        with open(result) as f:
            saved = json.load(f)
    if saved["failed"]:
        raise RuntimeError(f"{saved['failed']} requests failed; the first: {saved['errors'][0]}")
    return saved["output_throughput"], saved["total_output_tokens"] / cpu


def measure_online(args, configs: dict, paths: list[str], tokens: int):
    """Per config, the (wall, CPU-time) output tok/s of each round."""
    rates: dict[str, list[float]] = {name: [] for name in args.configs}
    cpu_rates: dict[str, list[float]] = {name: [] for name in args.configs}
    with ExitStack() as stack:
        servers = {}
        for name in args.configs:
            adapters, max_loras = configs[name]
            flags = server_flags(adapters, max_loras, paths, args.rank)
            process, url = stack.enter_context(
                running_server(flags, tokens, args.num_prompts, args.enforce_eager)
            )
            servers[name] = (psutil.Process(process.pid), url)
        for name, (process, url) in servers.items():  # warm-up, then the tapes recorded
            drive(url, process, args, configs[name][0], min(4, args.num_prompts))
            wait_idle(process)
        for round_ in range(args.repeats):
            for name, (process, url) in servers.items():
                wall, cpu = drive(url, process, args, configs[name][0], args.num_prompts)
                rates[name].append(wall)
                cpu_rates[name].append(cpu)
            print(
                f"round {round_ + 1}: " + ", ".join(f"{n} {r[-1]:.1f}" for n, r in rates.items()), flush=True
            )
    return rates, cpu_rates
