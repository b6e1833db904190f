"""Start-up, side by side in one run: seconds from launching a server to its first token, and its
peak memory, for ``engine serve`` and (where installed) ``vllm serve`` and llama.cpp's server.

    python benchmarks/startup.py [--model PATH] [--runs 3] [--vllm-python PATH]
                                 [--llama-server CMD] [--engine-args "..."]

Each run launches the server on a free port, polls ``/health`` until it answers 200 (``ready``),
sends one 1-token completion (``first token``: the time from launch to its answer), samples the
summed resident memory of the server's whole process tree every 50 ms (``peak RSS``), then stops
it. ``cold`` runs give the engine an empty cache folder (``XDG_CACHE_HOME``: its compiled C
kernels and its converted GGUF config, tokenizer and tensor names), ``warm`` runs the cache the
cold run filled; the other servers have no such cache and run warm only (the OS page cache is warm
for every server after its first run). The model is the embedded default (SmolLM2-135M Q4_1 GGUF)
unless ``--model`` names another (which every server then loads); for the default, vLLM loads
the same weights as a bf16 HF folder (``vs_vllm.py``'s, built once), llama.cpp the GGUF file.
Medians print with each server's ratio to this engine's warm time.

``--vllm-python``: vLLM's CPU build in its own venv (``vs_vllm.py --help`` has the set-up);
``--llama-server``: a command that serves a GGUF file given as ``--model PATH --port N`` (e.g.
``"VENV/bin/python -m llama_cpp.server"``, from ``pip install 'llama-cpp-python[server]'``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import psutil
from health import wait_healthy

from engine.testing.ports import free_port

sys.path.insert(0, os.path.dirname(__file__))


def tree_rss(process: psutil.Process) -> int:
    total = 0
    for p in [process, *process.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


class PeakMemory(threading.Thread):
    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.process, self.peak, self.stop = psutil.Process(pid), 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.peak = max(self.peak, tree_rss(self.process))
            except psutil.NoSuchProcess:
                return
            time.sleep(0.05)


def one_run(command: list[str], port: int, model_name: str | None, env=None, ready_path="/health") -> dict:
    """``ready_path``: the route that answers 200 once the server serves (llama.cpp's Python
    server has no /health). Its log goes to a file: a verbose server would fill a pipe and stall."""
    url, timeout = f"http://127.0.0.1:{port}", 600
    with tempfile.TemporaryFile(mode="w+") as log:
        launched = time.monotonic()
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
        memory = PeakMemory(process.pid)
        memory.start()
        try:
            wait_healthy(url + ready_path, process, timeout, poll=0.05, log_tail=lambda: _tail(log))
            ready = time.monotonic() - launched
            body = {"prompt": "Hello", "max_tokens": 1, **({"model": model_name} if model_name else {})}
            httpx.post(f"{url}/v1/completions", json=body, timeout=timeout).raise_for_status()
            first = time.monotonic() - launched
        finally:
            memory.stop.set()
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
    return {"ready_s": ready, "first_token_s": first, "peak_rss_mib": memory.peak / 2**20}


def _tail(log) -> str:
    log.seek(0)
    return log.read()[-2000:]


def engine_command(args, port: int) -> list[str]:
    engine = os.path.join(os.path.dirname(sys.executable), "engine")
    model = ["--model", args.model] if args.model else []
    return [
        engine,
        "serve",
        *model,
        "--port",
        str(port),
        "--served-model-name",
        "m",
        *shlex.split(args.engine_args),
    ]


def run_engine(args) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {"engine cold": [], "engine warm": []}
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "XDG_CACHE_HOME": cache}
            cold = one_run(engine_command(args, port := free_port()), port, "m", env)
            warm = one_run(engine_command(args, port := free_port()), port, "m", env)
        results["engine cold"].append(cold)
        results["engine warm"].append(warm)
        print(
            f"  run {run + 1}: cold {cold['first_token_s']:.1f} s, warm {warm['first_token_s']:.1f} s",
            flush=True,
        )
    return results


def run_others(args) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {}
    if args.vllm_python:
        import vs_vllm

        # vs_vllm's own `vllm serve` line; its folder unless --model names what every server loads
        folder = args.model or vs_vllm.hf_folder()
        settings = argparse.Namespace(vllm_python=args.vllm_python, model="default")
        for _ in range(args.runs):
            port = free_port()
            command = vs_vllm._server_command("vllm", settings, folder, port)
            results.setdefault("vllm", []).append(one_run(command, port, vs_vllm.SERVED_NAME["default"]))
    if args.llama_server:
        from engine_quant_gguf.loader import default_model_path

        path = args.model or default_model_path()
        for _ in range(args.runs):
            port = free_port()
            command = [*shlex.split(args.llama_server), "--model", path, "--port", str(port)]
            results.setdefault("llama.cpp", []).append(one_run(command, port, None, ready_path="/v1/models"))
    return results


def report(results: dict[str, list[dict]]) -> None:
    warm = statistics.median(r["first_token_s"] for r in results["engine warm"])
    print(f"\n{'server':<14}{'ready s':>9}{'first token s':>15}{'peak RSS MiB':>14}{'× engine warm':>15}")
    for name, runs in results.items():
        ready = statistics.median(r["ready_s"] for r in runs)
        first = statistics.median(r["first_token_s"] for r in runs)
        rss = statistics.median(r["peak_rss_mib"] for r in runs)
        print(f"{name:<14}{ready:>9.2f}{first:>15.2f}{rss:>14.0f}{first / warm:>15.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="a model path for every server (default: the embedded model)"
    )
    parser.add_argument(
        "--runs", type=int, default=3, help="launches per server and cache state; medians print"
    )
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"), help="vLLM's venv python")
    parser.add_argument(
        "--llama-server", default=None, help="a command serving a GGUF given --model and --port"
    )
    parser.add_argument("--engine-args", default="", help="extra `engine serve` flags, one quoted string")
    args = parser.parse_args()
    print(f"engine serve, {args.runs} runs (cold: empty cache folder; warm: the cache it filled)", flush=True)
    results = run_engine(args)
    results.update(run_others(args))
    if not args.vllm_python:
        print("(no --vllm-python: vLLM skipped)")
    if not args.llama_server:
        print("(no --llama-server: llama.cpp skipped)")
    report(results)


if __name__ == "__main__":
    main()
