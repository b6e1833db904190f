"""A `vllm serve` command line, unchanged but for the model: every flag is honoured, or
accepted with a one-line note saying why it has no effect here."""

from __future__ import annotations

import httpx

from tests.serving import serve

TEMPLATE = (
    "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}{% if add_generation_prompt %}=>{% endif %}"
)


def test_a_vllm_serve_line_works_unchanged(tiny_llama, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    line = [
        tiny_llama[0],  # positional MODEL
        "--served-model-name",
        "qwen",
        "--dtype",
        "float",
        "--max-model-len",
        "512",
        "--gpu-memory-utilization",
        "0.05",
        "--tensor-parallel-size",
        "1",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "256",
        "--enable-prefix-caching",
        "--seed",
        "0",
        "--trust-remote-code",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "deepseek_r1",
        "--chat-template",
        str(template),
        "--generation-config",
        "vllm",
        "--disable-log-requests",
        "--enable-log-requests",
        "--max-log-len",
        "12",
        "--uvicorn-log-level",
        "warning",
        "--allowed-origins",
        '["http://app.example"]',
        "--root-path",
        "/api",
    ]
    with serve(None, *line, api_key="k") as server:
        headers = {"Authorization": "Bearer k"}
        models = httpx.get(f"{server.url}/v1/models", headers=headers).json()["data"][0]
        assert models["id"] == "qwen" and models["max_model_len"] == 512
        assert httpx.get(f"{server.url}/v1/models").status_code == 401  # --api-key
        preflight = httpx.options(
            f"{server.url}/v1/chat/completions",
            headers={"Origin": "http://app.example", "Access-Control-Request-Method": "POST"},
        )
        assert (
            preflight.headers.get("access-control-allow-origin") == "http://app.example"
        )  # --allowed-origins
        ids = httpx.post(
            f"{server.url}/tokenize",
            headers=headers,
            json={"model": "qwen", "messages": [{"role": "user", "content": "hi"}]},
        ).json()["tokens"]
        assert server_text(server, ids) == "<<hi>>=>"  # --chat-template
        reply = httpx.post(
            f"{server.url}/v1/chat/completions",
            headers=headers,
            json={
                "model": "qwen",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
            },
        ).json()["choices"][0]["message"]
        # --reasoning-parser deepseek_r1: without </think> the whole output is reasoning
        assert reply["reasoning_content"] and not reply["content"]
        # ... and on /v1/responses a reasoning item, streamed as reasoning_text events
        body = {"model": "qwen", "input": "hi", "max_output_tokens": 6, "temperature": 0}
        response = httpx.post(f"{server.url}/v1/responses", headers=headers, json=body).json()
        [item] = response["output"]
        assert item["type"] == "reasoning" and reply["reasoning_content"].startswith(
            item["content"][0]["text"]
        )
        assert response["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
        with httpx.stream(
            "POST", f"{server.url}/v1/responses", headers=headers, json={**body, "stream": True}
        ) as stream:
            events = [line[7:] for line in stream.iter_lines() if line.startswith("event: ")]
        assert "response.reasoning_text.delta" in events and "response.output_text.delta" not in events
        info = next(
            line
            for line in httpx.get(f"{server.url}/metrics", headers=headers).text.splitlines()
            if line.startswith("vllm:cache_config_info{")
        )
        assert 'num_gpu_blocks="' in info and 'num_gpu_blocks="0"' not in info  # --gpu-memory-utilization
    log = server.process.stdout.read()
    assert "--trust-remote-code has no effect" in log
    assert "request chatcmpl-" in log and "prompt [" in log  # --enable-log-requests, cut to --max-log-len


def server_text(server, ids: list[int]) -> str:
    return httpx.post(
        f"{server.url}/detokenize",
        headers={"Authorization": "Bearer k"},
        json={"model": "qwen", "tokens": ids},
    ).json()["prompt"]
