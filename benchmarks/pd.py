"""Prefill/decode disaggregation against one colocated instance: TTFT and TPOT under
`engine bench serve` at a fixed request rate, on the same CPUs.

    python benchmarks/pd.py [--model PATH] [--connector p2p|nixl|NixlConnector|...] [--request-rate 1]
                            [--num-prompts 48] [--input-len 512] [--output-len 64] [--out FILE.json]

Colocated: one `engine serve` on every CPU of this process. P/D: a prefill instance
(`kv_role` kv_producer) on the first half of the CPUs and a decode instance (kv_consumer) on the
other half, joined by ``--connector`` (any installed P/D connector under any of its registered
names, vLLM's included; default p2p), with `engine proxy` in front. The same seeded random
workload (`--ignore-eos`, exact lengths, Poisson arrivals) is sent to each in turn (colocated, then
P/D, `--rounds` times); the medians and p99s of TTFT and TPOT are printed with their P/D /
colocated ratios, and all results are written to ``--out``. Without ``--model`` the server's
embedded default model (SmolLM2-135M-Instruct, GGUF) is served.

What to expect: P/D keeps prefills off the decode instance, so TPOT stays flat while prompts
arrive (colocated decodes share steps with prefill chunks); TTFT pays the hop through the proxy,
the prefill instance's one token and the block transfer, on half the CPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from engine.kv_transfer import PDConnector
from engine.plugins import RegistrationError, load_plugins
from engine.testing.ports import free_port

ENGINE = os.path.join(os.path.dirname(sys.executable), "engine")
METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "request_throughput")


@contextlib.contextmanager
def process(command: list[str], url: str, cpus: set[int] | None = None, timeout: float = 900):
    """A server process pinned to ``cpus`` (its engine core inherits them), once ``url`` answers."""
    env = {**os.environ, **({"OMP_NUM_THREADS": str(len(cpus))} if cpus else {})}
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    if cpus:  # before its imports are done, so before it spawns its engine core
        os.sched_setaffinity(proc.pid, cpus)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{command[:2]} exited with {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{command[:2]} did not start")
            time.sleep(0.5)
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def pd_connector(name: str) -> str:
    """``name`` if an installed P/D connector is registered under it (argparse's ``--connector`` check)."""
    installed = [r.name for r in load_plugins().registrations("kv_connectors") if _is_pd(r)]
    if name not in installed:
        raise argparse.ArgumentTypeError(
            f"{name!r} is no installed P/D connector (installed: {', '.join(installed)})"
        )
    return name


def _is_pd(registration) -> bool:
    try:
        return issubclass(registration.load(), PDConnector)
    except RegistrationError:  # it cannot load here
        return False


def serve_command(args, port: int, transfer: dict | None = None) -> list[str]:
    command = [
        ENGINE,
        "serve",
        "--port",
        str(port),
        "--max-model-len",
        str(args.input_len + args.output_len + 16),
    ]
    if args.model:
        command += ["--model", args.model]
    if args.dtype:
        command += ["--dtype", args.dtype]
    if transfer:
        command += ["--kv-transfer-config", json.dumps(transfer)]
    return command


def bench(args, base_url: str, label: str, folder: str) -> dict:
    path = os.path.join(folder, f"{label}.json")
    subprocess.run(
        [
            ENGINE,
            "bench",
            "serve",
            "--base-url",
            base_url,
            "--request-rate",
            str(args.request_rate),
            "--num-prompts",
            str(args.num_prompts),
            "--random-input-len",
            str(args.input_len),
            "--random-output-len",
            str(args.output_len),
            "--ignore-eos",
            "--seed",
            str(args.seed),
            "--num-warmups",
            "1",
            "--disable-tqdm",
            "--save-result",
            path,
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    with open(path) as f:
        return json.load(f)


def colocated(args, folder: str) -> dict:
    port = free_port()
    with process(serve_command(args, port), f"http://127.0.0.1:{port}/health"):
        return bench(args, f"http://127.0.0.1:{port}", "colocated", folder)


def disaggregated(args, folder: str) -> dict:
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    prefill_cpus, decode_cpus = set(cpus[:half]), set(cpus[half:] or cpus[:half])
    prefill_port, decode_port, proxy_port, kv_port = free_port(), free_port(), free_port(), free_port()
    producer = {
        "kv_connector": args.connector,
        "kv_role": "kv_producer",
        "kv_ip": "127.0.0.1",
        "kv_port": kv_port,
    }
    consumer = {"kv_connector": args.connector, "kv_role": "kv_consumer"}
    proxy = [
        ENGINE,
        "proxy",
        "--port",
        str(proxy_port),
        "--prefill",
        f"http://127.0.0.1:{prefill_port}",
        "--decode",
        f"http://127.0.0.1:{decode_port}",
    ]
    with (
        process(
            serve_command(args, prefill_port, producer),
            f"http://127.0.0.1:{prefill_port}/health",
            prefill_cpus,
        ),
        process(
            serve_command(args, decode_port, consumer), f"http://127.0.0.1:{decode_port}/health", decode_cpus
        ),
        process(proxy, f"http://127.0.0.1:{proxy_port}/health"),
    ):
        return bench(args, f"http://127.0.0.1:{proxy_port}", "pd", folder)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default=None)
    parser.add_argument(
        "--connector",
        type=pd_connector,
        default="p2p",
        help="the P/D instances' kv_connector: p2p, nixl (or vLLM's NixlConnector), ...",
    )
    parser.add_argument("--request-rate", type=float, default=1.0, help="requests/s (Poisson)")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1, help="colocated then P/D, this many times")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write every result here (JSON)")
    args = parser.parse_args()
    runs = {"colocated": [], "pd": []}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.rounds):
            runs["colocated"].append(colocated(args, folder))
            runs["pd"].append(disaggregated(args, folder))
    print(
        f"{args.num_prompts} requests at {args.request_rate}/s, {args.input_len} in / {args.output_len} out, "
        f"{len(os.sched_getaffinity(0))} CPUs (P/D: half each, {args.connector})"
    )
    print(f"{'':<20}" + "".join(f"{name:>20}" for name in METRICS))
    for label, results in runs.items():
        for result in results:
            print(f"{label:<20}" + "".join(f"{result[name]:>20.2f}" for name in METRICS))
    for name in METRICS:
        ratios = [pd[name] / co[name] for pd, co in zip(runs["pd"], runs["colocated"]) if co[name]]
        print(f"P/D / colocated {name}: " + ", ".join(f"{r:.2f}x" for r in ratios))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), **runs}, f, indent=2)


if __name__ == "__main__":
    main()
