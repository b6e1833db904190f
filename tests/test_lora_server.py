"""LoRA adapters over a real ``engine serve`` with the ``openai`` client: adapters from
``--lora-modules`` (both spellings) in concurrent mixed streams whose greedy text equals the
offline ``LLM`` under the same adapters, ``/v1/models`` with each adapter's parent, runtime
load and unload (also with a stream in flight), the filesystem resolver, the metrics, and every
bad input a clear 4xx with the server still serving. Then a server without runtime updating
(no load routes, no resolving), and start-up refusals in one line."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, LoRARequest, SamplingParams
from engine_server.lora import LoRAModulePath, parse_lora_module
from tests.plugin_packages import environ_with, write_distribution
from tests.serving import ENGINE, Streams, serve

peft = pytest.importorskip("peft")
pytest.importorskip("engine_loraresolvers_filesystem", reason="the filesystem LoRA resolver is not installed")

from tests.test_lora import save_adapter

ARGS = ("--dtype", "float32", "--num-blocks", "256", "--block-size", "16", "--max-model-len", "512")
LORA = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--max-cpu-loras", "4")
ADAPTERS = {  # name -> (LoraConfig fields, seed)
    "sql": (dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]), 1),
    "chat": (dict(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "o_proj", "down_proj"]), 2),
    "late": (dict(r=8, lora_alpha=8, target_modules=["gate_proj", "up_proj"]), 3),
    "found": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"]), 4),
    "wide": (dict(r=32, lora_alpha=32, target_modules=["q_proj"]), 5),  # above --max-lora-rank 16
}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "SELECT name FROM"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def folders(tiny_llama, tmp_path_factory):
    """``allowed/`` (runtime loads read here) holds the adapters and broken ones; ``cache/`` is
    the resolver's folder; ``outside/`` is neither."""
    root = tmp_path_factory.mktemp("lora-server")
    allowed, cache, outside = root / "allowed", root / "cache", root / "outside"
    for name, (fields, seed) in ADAPTERS.items():
        parent = cache if name == "found" else allowed
        save_adapter(tiny_llama[0], str(parent / name), seed, **fields)
    shutil.copytree(allowed / "late", outside / "stray")
    os.symlink(outside / "stray", allowed / "link-out")
    _damaged(allowed)
    return root


def _damaged(allowed) -> None:
    """Broken copies of ``sql``: a target the model lacks, a shape not the model's, a truncated file."""
    weights = load_file(str(allowed / "sql" / "adapter_model.safetensors"))
    for name, change in {
        "deeper": lambda t: {k.replace("layers.1.", "layers.7."): v for k, v in t.items()},
        "wider": lambda t: {k: torch.zeros(v.shape[0], 96) if "lora_A" in k else v for k, v in t.items()},
    }.items():
        shutil.copytree(allowed / "sql", allowed / name)
        save_file(change(weights), str(allowed / name / "adapter_model.safetensors"))
    shutil.copytree(allowed / "sql", allowed / "truncated")
    data = (allowed / "truncated" / "adapter_model.safetensors").read_bytes()
    (allowed / "truncated" / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])


FAILING_RESOLVER = """
    from engine import hookimpl
    from engine.interfaces import LoRAResolver


    class Failing(LoRAResolver):
        def resolve(self, base_model_name, lora_name):
            raise RuntimeError("the adapter store is down")


    @hookimpl
    def register_lora_resolvers(register):
        register("failing", Failing, api=1)
    """


@pytest.fixture(scope="module")
def server(tiny_llama, folders):
    """With a resolver that always raises, asked before the filesystem one (entry points by name)."""
    site = folders / "site"
    write_distribution(
        site, "tessellm-loraresolvers-broken", "loraresolvers-broken", "engine_broken", FAILING_RESOLVER
    )
    modules = [
        f"sql={folders / 'allowed' / 'sql'}",
        json.dumps({"name": "chat", "path": str(folders / "allowed" / "chat")}),
    ]
    with serve(
        tiny_llama[0],
        *ARGS,
        *LORA,
        "--lora-modules",
        *modules,
        "--allow-runtime-lora-updating",
        "--lora-allowed-dir",
        str(folders / "allowed"),
        "--lora-resolver-cache-dir",
        str(folders / "cache"),
        env=environ_with(site),
    ) as s:
        yield s


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(
        tiny_llama[0],
        dtype="float32",
        num_blocks=256,
        block_size=16,
        max_model_len=512,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        max_cpu_loras=4,
    )


def offline_texts(offline, folders, prompts, models) -> list[str]:
    """Greedy text of each prompt under its model's adapter (the base for None), offline."""
    ids = {name: i for i, name in enumerate(ADAPTERS, start=1)}
    requests = [
        None
        if m is None
        else LoRARequest(m, ids[m], str(folders / ("cache" if m == "found" else "allowed") / m))
        for m in models
    ]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return [o.outputs[0].text for o in offline.generate(prompts, params, lora_request=requests)]


def completion(server, model: str, prompt: str = PROMPTS[0]) -> str:
    client = server.openai()
    answer = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert answer.model == model
    return answer.choices[0].text


def post(server, route: str, body: dict) -> httpx.Response:
    with server.http() as http:
        return http.post(route, json=body)


def test_lora_modules_take_both_spellings():
    assert parse_lora_module("sql=/a/b=c") == LoRAModulePath("sql", "/a/b=c")
    spelled = parse_lora_module('{"name": "chat", "path": "/a", "base_model_name": "base"}')
    assert spelled == LoRAModulePath("chat", "/a", "base")
    for bad in ["sql", "=path", "sql=", '{"name": "x"}', '{"name": "x", "path": "p", "rank": 8}', "{oops"]:
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lora_module(bad)


def test_models_lists_each_adapter_under_its_base(server, folders):
    models = {m.id: m for m in server.openai().models.list().data}
    base = server.model()
    assert list(models)[:3] == [base, "sql", "chat"]
    assert models[base].parent is None
    for name in ("sql", "chat"):
        assert models[name].parent == base
        assert models[name].root == str(folders / "allowed" / name)


def test_mixed_adapter_streams_equal_the_offline_engine(server, offline, folders):
    base = server.model()
    models = [None, "sql", "chat", "sql", None, "chat", "chat", None]
    prompts = [PROMPTS[i % 2] for i in range(len(models))]  # each prompt under the base and both adapters

    async def one(client, model, prompt) -> str:
        stream = await client.completions.create(
            model=model or base,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def all_at_once():
        async with server.openai(openai.AsyncOpenAI) as client:
            return await asyncio.gather(*(one(client, m, p) for m, p in zip(models, prompts)))

    served = asyncio.run(all_at_once())
    assert served == offline_texts(offline, folders, prompts, models)
    assert len({served[0], served[1], served[2]}) == 3, "each adapter changes the base model's text"


def test_chat_with_an_adapter_equals_the_offline_engine(server, offline, folders):
    messages = [{"role": "user", "content": "Write a query."}]
    answer = server.openai().chat.completions.create(
        model="chat", messages=messages, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert answer.model == "chat"
    lora = LoRARequest("chat", 2, str(folders / "allowed" / "chat"))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    assert (
        answer.choices[0].message.content
        == offline.chat(messages, params, lora_request=lora)[0].outputs[0].text
    )


def test_an_unknown_model_is_a_404_and_nothing_else_changes(server):
    with pytest.raises(openai.NotFoundError) as caught:
        completion(server, "no-such-adapter")
    assert caught.value.body["code"] == "model_not_found"
    assert caught.value.body["message"] == "The model `no-such-adapter` does not exist."
    assert completion(server, "sql")


def test_runtime_load_serves_the_adapter_and_unload_stops_it(server, offline, folders):
    path = str(folders / "allowed" / "late")
    loaded = post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": path})
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'late' added successfully."
    assert {m.id: m.parent for m in server.openai().models.list().data}["late"] == server.model()
    assert completion(server, "late") == offline_texts(offline, folders, [PROMPTS[0]], ["late"])[0]

    again = post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": path})
    assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]

    unloaded = post(server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert (
        unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'late' removed successfully."
    )
    with pytest.raises(openai.NotFoundError):
        completion(server, "late")
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 404
    assert "late" not in {m.id for m in server.openai().models.list().data}


def test_unloading_with_a_stream_in_flight_lets_it_finish(server, folders):
    path = str(folders / "allowed" / "late")
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "busy", "lora_path": path}).status_code == 200
    streams = Streams(server, 1, model="busy", max_tokens=64, temperature=0)
    streams.wait_started()
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "busy"}).status_code == 200
    assert "[DONE]" not in streams.frames[0], "the stream must still be running when its adapter goes"
    with pytest.raises(openai.NotFoundError):
        completion(server, "busy")
    for frames in streams.join():
        assert frames[-1] == "[DONE]" and not any('"error"' in f for f in frames)
        assert json.loads(frames[-2])["choices"][0]["finish_reason"] == "length"


BAD_LOADS = {  # lora_path (in allowed/) -> (status, what the message says)
    "nowhere": (400, "no adapter_config.json"),
    "wide": (400, r"rank 32, above max_lora_rank=16"),
    "deeper": (400, r"layers\.7\.self_attn\.\w_proj, which the base model lacks"),
    "wider": (400, r"does not match the base model's \[\d+ x 64\]"),
    "truncated": (400, "adapter_model.safetensors is corrupt or truncated"),
    "../outside/stray": (400, "outside the allowed folder"),
    "link-out": (400, "outside the allowed folder"),
}


@pytest.mark.parametrize("path", sorted(BAD_LOADS))
def test_a_bad_adapter_is_a_400_with_the_reason(server, folders, path):
    status, reason = BAD_LOADS[path]
    answer = post(server, "/v1/load_lora_adapter", {"lora_name": f"bad-{path}", "lora_path": path})
    assert answer.status_code == status, answer.text
    assert re.search(reason, answer.json()["error"]["message"]), answer.json()
    assert f"bad-{path}" not in {m.id for m in server.openai().models.list().data}
    assert completion(server, "sql")  # still serving


def test_an_adapter_failing_at_request_time_fails_that_request_alone(server, folders):
    """An adapter whose files vanish after it was loaded, and which the core's memory then drops
    (four adapters loaded after it, --max-cpu-loras 4), is read again by its next request: that
    request is a 400 with the loader's reason, and the others are served."""
    fragile = folders / "allowed" / "fragile"
    shutil.copytree(folders / "allowed" / "late", fragile)
    assert (
        post(server, "/v1/load_lora_adapter", {"lora_name": "fragile", "lora_path": "fragile"}).status_code
        == 200
    )
    shutil.rmtree(fragile)
    for i in range(4):
        body = {"lora_name": f"filler-{i}", "lora_path": "late"}
        assert post(server, "/v1/load_lora_adapter", body).status_code == 200
    with pytest.raises(openai.BadRequestError, match="no adapter_config.json"):
        completion(server, "fragile")
    assert completion(server, "sql") and completion(server, server.model())


def test_malformed_load_requests_are_400s(server):
    for body in [{"lora_name": "x"}, {"lora_path": "sql"}, {"lora_name": server.model(), "lora_path": "sql"}]:
        assert post(server, "/v1/load_lora_adapter", body).status_code == 400, body
    assert post(server, "/v1/unload_lora_adapter", {}).status_code == 400
    anonymous = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "late"})
    assert anonymous.status_code == 401  # behind --api-key, as every route but /health


def test_the_resolver_serves_an_adapter_from_its_folder(server, offline, folders):
    """The failing resolver, asked first, is passed over."""
    assert completion(server, "found") == offline_texts(offline, folders, [PROMPTS[0]], ["found"])[0]
    assert {m.id: m.root for m in server.openai().models.list().data}["found"] == str(
        folders / "cache" / "found"
    )
    with pytest.raises(openai.NotFoundError):
        completion(server, "../allowed/sql")  # the resolver never leaves its folder


def test_metrics_count_requests_per_adapter(server):
    for _ in range(2):
        completion(server, "chat")
    text = httpx.get(f"{server.url}/metrics", headers=server.headers).text
    info = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0], info
    assert 'running_lora_adapters=""' in info[0] and 'waiting_lora_adapters=""' in info[0]  # all finished
    counts = re.findall(r'^vllm:lora_requests_total\{[^}]*lora_name="chat"[^}]*\} (\S+)$', text, re.MULTILINE)
    assert len(counts) == 1 and float(counts[0]) >= 2, counts


@pytest.mark.slow  # a server of its own
def test_without_runtime_updating_there_are_no_load_routes_and_no_resolving(tiny_llama, folders):
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ALLOW_RUNTIME_LORA_UPDATING"}
    env["VLLM_LORA_RESOLVER_CACHE_DIR"] = str(folders / "cache")
    with serve(
        tiny_llama[0], *ARGS, *LORA, "--lora-modules", f"sql={folders / 'allowed' / 'sql'}", env=env
    ) as s:
        body = {"lora_name": "late", "lora_path": str(folders / "allowed" / "late")}
        assert post(s, "/v1/load_lora_adapter", body).status_code == 404
        with pytest.raises(openai.NotFoundError):
            completion(s, "found")
        assert completion(s, "sql")


@pytest.mark.slow  # an engine start of its own
def test_a_bad_adapter_at_start_stops_the_server_with_one_line(tiny_llama, folders):
    command = [ENGINE, "serve", tiny_llama[0], *ARGS, *LORA, "--port", "0"]
    wide = folders / "allowed" / "wide"
    run = subprocess.run(
        [*command, "--lora-modules", f"wide={wide}"], check=False, capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 1
    assert f"engine serve: --lora-modules wide={wide}: LoRA adapter 'wide'" in run.stderr
    assert "rank 32, above max_lora_rank=16" in run.stderr and "Traceback" not in run.stderr
    without = subprocess.run(
        [ENGINE, "serve", tiny_llama[0], "--lora-modules", f"sql={wide}"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert without.returncode != 0 and "--lora-modules needs --enable-lora" in without.stderr


def _adapter_counts(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", headers=server.headers).text
    found = re.findall(r'^vllm:lora_requests_total\{[^}]*lora_name="(\w+)"[^}]*\} (\S+)$', text, re.MULTILINE)
    return {name: float(count) for name, count in found}


def test_bench_serve_spreads_requests_over_lora_modules(server, tmp_path):
    """``engine bench serve --lora-modules`` (vLLM's flag, for ``benchmarks/lora.py --online``):
    each request names one of the adapters, picked at random with the seed."""
    before = _adapter_counts(server)
    result = subprocess.run(
        [ENGINE, "bench", "serve", "--base-url", server.url, "--api-key", server.api_key]
        + ["--num-prompts", "6", "--random-input-len", "8", "--random-output-len", "4", "--ignore-eos"]
        + ["--seed", "0", "--disable-tqdm", "--save-result", str(tmp_path / "r.json")]
        + ["--lora-modules", "sql", "chat"],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads((tmp_path / "r.json").read_text())["completed"] == 6
    after = _adapter_counts(server)
    sent = {name: after.get(name, 0) - before.get(name, 0) for name in ("sql", "chat")}
    assert sent == {"sql": 1, "chat": 5}  # random.Random(0)'s six picks of the two
