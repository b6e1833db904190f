"""`engine bench serve` against a real server: token-exact random prompts, the chat endpoint,
a concurrency cap, a ShareGPT file, and the saved JSON with `vllm bench serve`'s keys — against
`engine serve`, and against `vllm serve` when a vLLM environment is given."""

from __future__ import annotations

import json
import os
import subprocess
import time

import httpx
import pytest

from tests.conftest import TINY_LLAMA
from tests.serving import ENGINE, free_port, serve

# The keys `vllm bench serve --save-result` writes (with the default percentile 99).
VLLM_KEYS = {
    "date",
    "endpoint_type",
    "label",
    "model_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "latencies",
    "start_times",
    "generated_texts",
    "errors",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
} | {f"{stat}_{name}_ms" for stat in ("mean", "median", "std", "p99") for name in ("ttft", "tpot", "itl")}

ARGS = ("--dtype", "float32", "--num-blocks", "128", "--max-model-len", "512")


def bench(url: str, out, *flags: str, api_key: str | None = None) -> dict:
    command = [
        ENGINE,
        "bench",
        "serve",
        "--base-url",
        url,
        "--save-result",
        str(out),
        "--disable-tqdm",
        *flags,
    ]
    result = subprocess.run(
        command + (["--api-key", api_key] if api_key else []),
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Serving Benchmark Result" in result.stdout and "Median TTFT (ms):" in result.stdout
    return json.loads(out.read_text())


def test_random_completions_have_exact_token_lengths(tiny_llama, tmp_path):
    with serve(tiny_llama[0], *ARGS, api_key="k") as server:
        saved = bench(
            server.url,
            tmp_path / "r.json",
            "--num-prompts",
            "12",
            "--request-rate",
            "30",
            "--burstiness",
            "0.5",
            "--random-input-len",
            "20",
            "--random-output-len",
            "10",
            "--random-range-ratio",
            "0.5",
            "--ignore-eos",
            "--goodput",
            "ttft:5000",
            "tpot:1000",
            api_key="k",
        )
    assert VLLM_KEYS <= set(saved)
    assert saved["completed"] == 12 and saved["failed"] == 0 and saved["request_goodput"] > 0
    assert all(10 <= n <= 30 for n in saved["input_lens"]) and len(set(saved["input_lens"])) > 1
    assert all(5 <= n <= 15 for n in saved["output_lens"]) and len(set(saved["output_lens"])) > 1
    assert sum(saved["output_lens"]) == saved["total_output_tokens"] and saved["output_throughput"] > 0
    assert saved["p99_ttft_ms"] >= saved["median_ttft_ms"] > 0


def test_chat_endpoint_with_concurrency_cap_and_sharegpt_file(tiny_llama, tmp_path):
    conversations = [
        {
            "conversations": [
                {"from": "human", "value": f"Tell me about river number {i} please."},
                {"from": "gpt", "value": "It is long and wide and it flows to the sea."},
            ]
        }
        for i in range(10)
    ]
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(conversations))
    with serve(tiny_llama[0], *ARGS, api_key=None) as server:
        saved = bench(
            server.url,
            tmp_path / "c.json",
            "--endpoint",
            "/v1/chat/completions",
            "--max-concurrency",
            "3",
            "--num-prompts",
            "9",
            "--dataset-name",
            "sharegpt",
            "--dataset-path",
            str(dataset),
            "--ignore-eos",
            "--sharegpt-output-len",
            "6",
        )
    assert VLLM_KEYS <= set(saved)
    assert saved["completed"] == 9 and saved["max_concurrency"] == 3
    assert 1 <= saved["max_concurrent_requests"] <= 3
    assert saved["output_lens"] == [6] * 9
    assert all(n > 10 for n in saved["input_lens"])  # the chat template's tokens are counted too


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("VLLM_PYTHON"), reason="set VLLM_PYTHON to a vLLM environment's python"
)
def test_same_keys_against_vllm_serve(default_tokenizer, tmp_path):
    """The same run against `vllm serve` (vLLM in its own environment) on a tiny random
    Llama whose head size vLLM's CPU kernels take (64)."""
    from engine.testing import reference

    folder = str(tmp_path / "model")
    reference.tiny_checkpoint(
        folder,
        "LlamaForCausalLM",
        {**TINY_LLAMA, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1},
        tokenizer=default_tokenizer,
    )
    port = free_port()
    vllm = os.path.join(os.path.dirname(os.environ["VLLM_PYTHON"]), "vllm")
    process = subprocess.Popen(
        [
            vllm,
            "serve",
            folder,
            "--port",
            str(port),
            "--max-model-len",
            "512",
            "--dtype",
            "float32",
            "--gpu-memory-utilization",
            "0.1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while not _healthy(url):
            assert process.poll() is None and time.monotonic() < deadline, "vllm serve did not start"
            time.sleep(1)
        saved = bench(
            url,
            tmp_path / "v.json",
            "--endpoint",
            "/v1/chat/completions",
            "--max-concurrency",
            "8",
            "--num-prompts",
            "16",
            "--random-input-len",
            "32",
            "--random-output-len",
            "8",
            "--ignore-eos",
        )
    finally:
        process.terminate()
        process.wait(60)
    assert VLLM_KEYS <= set(saved) and saved["completed"] == 16


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
