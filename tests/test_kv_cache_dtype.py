"""--kv-cache-dtype fp8 end to end on a tiny random Llama: the pool holds twice the tokens of a
bf16 cache at one byte budget, greedy tokens and teacher-forced log-probs stay close to the
bf16 cache's (tolerances below), prefix caching serves the same tokens, checkpoint KV scales
load, and what cannot run is refused at start-up in one line naming it."""

from __future__ import annotations

import argparse
import os
import shutil
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams, hookimpl
from engine.config import KV_CACHE_DTYPE_NAMES, EngineConfig
from engine.core import kv_connectors, setup
from engine.entrypoints.cli_args import add_engine_arguments
from engine.interfaces import KV_CACHE_DTYPES, KVScale
from engine.kv_transfer.layout import BlockLayout
from engine.layers.attention import Attention
from engine.plugins import add_plugin, remove_plugin
from engine_attention_torch.backend import TorchAttentionBackend
from tests.serving import serve

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
]
BUDGET = 2 * 2**20  # bytes of KV cache for every engine here
# against the bf16 cache, teacher-forced over the bf16 run's own greedy tokens: the least share of
# positions whose most likely next token agrees, and the largest mean absolute log-prob difference
# of the actual token. This random model's logits are flat (mean log-prob about -6.5) and its
# attention logits sharp, so a few percent of error per K/V value moves them more than a trained
# model's: measured 0.85 / 0.14 (e4m3) and 0.70 / 0.35 (e5m2, one mantissa bit fewer); the default
# model's figures are in benchmarks/RESULTS.md.
TOLERANCE = {"fp8": (0.75, 0.25), "fp8_e5m2": (0.6, 0.6)}


class _Bf16Only(TorchAttentionBackend):
    """The torch backend declaring no quantized KV dtype, as a backend written before them."""

    name = "test-bf16-only"
    kv_cache_dtypes = ()


@hookimpl
def register_attention_backends(register):
    register("test-bf16-only", _Bf16Only, api=4)


def _llm(folder: str, kv_cache_dtype: str, **kwargs) -> LLM:
    return LLM(
        folder,
        dtype="bfloat16",
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory=BUDGET,
        block_size=16,
        enforce_eager=True,
        **kwargs,
    )


@pytest.fixture(scope="module")
def engines(tiny_llama):
    return {dtype: _llm(tiny_llama[0], dtype) for dtype in ("auto", "fp8", "fp8_e5m2")}


def test_the_names_agree_with_the_dtypes():
    assert set(KV_CACHE_DTYPE_NAMES) == set(KV_CACHE_DTYPES)
    assert KV_CACHE_DTYPES["fp8"] is torch.float8_e4m3fn


def test_fp8_holds_twice_the_tokens_of_bf16_at_one_budget(engines):
    auto, fp8 = (engines[d].engine.num_blocks for d in ("auto", "fp8"))
    assert fp8 == pytest.approx(2 * auto, abs=1)
    caches = engines["fp8"].engine.runner.kv_caches
    assert {c.dtype for c in caches} == {torch.float8_e4m3fn}
    assert sum(c.numel() * c.element_size() for c in caches) <= BUDGET


def _greedy(llm: LLM):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]


def _teacher_forced(llm: LLM, sequences) -> tuple[list[int], torch.Tensor]:
    """Each position's most likely next token and the log-prob of the actual one, given the
    tokens before it (the whole sequence as the prompt)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params)
    top, logprobs = [], []
    for seq, out in zip(sequences, outs):
        for token, entry in zip(seq[1:], out.prompt_logprobs[1:]):
            top.append(min(entry.items(), key=lambda item: item[1].rank)[0])
            logprobs.append(entry[token].logprob)
    return top, torch.tensor(logprobs)


@pytest.mark.parametrize("kv_cache_dtype", sorted(TOLERANCE))
def test_fp8_next_tokens_and_log_probs_stay_close_to_bf16(engines, kv_cache_dtype):
    tokenizer = engines["auto"].tokenizer
    sequences = [tokenizer.encode(p) + list(t) for p, t in zip(PROMPTS, _greedy(engines["auto"]))]
    base_top, base = _teacher_forced(engines["auto"], sequences)
    top, logprobs = _teacher_forced(engines[kv_cache_dtype], sequences)
    min_agreement, max_drift = TOLERANCE[kv_cache_dtype]
    assert sum(a == b for a, b in zip(base_top, top)) / len(top) >= min_agreement
    assert float((base - logprobs).abs().mean()) <= max_drift


def test_fp8_prefix_cache_hits_give_the_same_tokens(engines):
    """The second run reads the first one's fp8 blocks from the prefix cache."""
    llm = engines["fp8"]
    long_prompt = " ".join(PROMPTS * 4)
    first = _greedy_one(llm, long_prompt)
    hits = llm.engine.kv_cache_manager.stats["prefix_hits"]
    assert _greedy_one(llm, long_prompt) == first
    assert llm.engine.kv_cache_manager.stats["prefix_hits"] > hits


def _greedy_one(llm: LLM, prompt: str):
    return llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0].token_ids


def test_checkpoint_kv_scales_load_into_the_attention_layers(tiny_llama, tmp_path):
    folder = str(tmp_path / "scaled")
    shutil.copytree(tiny_llama[0], folder)
    path = os.path.join(folder, "model.safetensors")
    weights = load_file(path)
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    weights["model.layers.0.self_attn.v_scale"] = torch.tensor(0.25)
    weights["model.layers.1.self_attn.kv_scale"] = torch.tensor(2.0)
    save_file(weights, path, metadata={"format": "pt"})
    llm = _llm(folder, "fp8")
    layers = {m.layer_index: m.kv_scale for m in llm.engine.model.modules() if isinstance(m, Attention)}
    assert layers == {0: KVScale(0.5, 0.25), 1: KVScale(2.0, 2.0)}
    assert len(_greedy_one(llm, PROMPTS[0])) == 8


@pytest.fixture
def bf16_only():
    """``test-bf16-only`` registered for one test (other tests' automatic selection never sees it)."""
    plugin = types.SimpleNamespace(register_attention_backends=register_attention_backends)
    add_plugin(plugin, "test-bf16-only")
    yield
    remove_plugin("test-bf16-only")


def test_a_backend_that_cannot_read_fp8_is_refused_naming_both(tiny_llama, bf16_only):
    with pytest.raises(RuntimeError, match=r"'test-bf16-only'.*cannot read a float8_e4m3fn KV cache"):
        _llm(tiny_llama[0], "fp8", attention_backend="test-bf16-only")


def test_a_bad_kv_cache_dtype_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"kv_cache_dtype: 'fp4' is not one of auto, fp8"):
        EngineConfig.from_kwargs(kv_cache_dtype="fp4")
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_arguments(parser)
    assert parser.parse_args(["--kv-cache-dtype", "fp8_e5m2"]).kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(argparse.ArgumentError, match="--kv-cache-dtype"):
        parser.parse_args(["--kv-cache-dtype", "int4"])


def test_calculated_kv_scales_come_from_the_first_prefill_once(tiny_llama, monkeypatch):
    """``--calculate-kv-scales``: each layer's scales are the first prefill's max |k| / 200 and
    max |v| / 100 (as the layer hands k and v to its backend), and a later prompt leaves them."""
    first: dict[int, tuple[float, float]] = {}
    attend = Attention._attend

    def watched(self, backend, q, k, v, *rest):
        first.setdefault(self.layer_index, (float(k.abs().max()), float(v.abs().max())))
        return attend(self, backend, q, k, v, *rest)

    monkeypatch.setattr(Attention, "_attend", watched)
    llm = _llm(tiny_llama[0], "fp8", calculate_kv_scales=True)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, Attention)]
    assert layers and all(layer.calculate_kv_scale for layer in layers)
    _greedy_one(llm, PROMPTS[0])
    for layer in layers:
        k_max, v_max = first[layer.layer_index]
        assert layer.kv_scale == KVScale(k=k_max / 200, v=v_max / 100) and not layer.calculate_kv_scale
    scales = [layer.kv_scale for layer in layers]
    _greedy_one(llm, " ".join(PROMPTS))
    assert [layer.kv_scale for layer in layers] == scales


def test_a_server_started_with_vllms_fp8_flags_generates_what_the_offline_engine_does(tiny_llama):
    """``engine serve --kv-cache-dtype fp8 --calculate-kv-scales``, as vLLM command lines write
    it: the greedy completion over HTTP equals the offline engine's with the same options."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    offline = _llm(tiny_llama[0], "fp8", calculate_kv_scales=True).generate([PROMPTS[0]], params)
    flags = ["--dtype", "bfloat16", "--kv-cache-dtype", "fp8", "--calculate-kv-scales"]
    with serve(tiny_llama[0], *flags, "--kv-cache-memory", str(BUDGET), "--block-size", "16") as server:
        client = server.openai()
        completion = client.completions.create(
            model=server.model(),
            prompt=PROMPTS[0],
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    assert completion.choices[0].text == offline[0].outputs[0].text


def test_calculate_kv_scales_is_vllms_flag_and_needs_a_quantized_cache_to_act():
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_arguments(parser)
    assert parser.parse_args(["--calculate-kv-scales"]).calculate_kv_scales is True
    config = EngineConfig.from_kwargs(calculate_kv_scales=True)  # auto cache: nothing to calculate
    layer = Attention(0)
    model = torch.nn.ModuleList([layer])
    setup.calculate_kv_scales(model, config)
    assert not layer.calculate_kv_scale
    setup.calculate_kv_scales(model, EngineConfig.from_kwargs(calculate_kv_scales=True, kv_cache_dtype="fp8"))
    assert layer.calculate_kv_scale
    with pytest.raises(ValueError, match="calculate_kv_scales: not with a KV connector"):
        config = EngineConfig.from_kwargs(
            calculate_kv_scales=True, kv_cache_dtype="fp8", kv_connector="offload"
        )
        kv_connectors.build_halves(None, config, [torch.zeros(2, 4)], 0)


def test_transfers_between_fp8_and_bf16_caches_are_refused_by_dtype():
    """P/D and offload connectors move blocks only between equal layouts: the fp8 bytes of one
    instance are never read as another's bf16."""
    shape = (2, 2, 4, 16, 32)
    fp8 = BlockLayout.of([torch.zeros(shape, dtype=torch.float8_e4m3fn)], 2, 16)
    bf16 = BlockLayout.of([torch.zeros(shape, dtype=torch.bfloat16)], 2, 16)
    assert fp8.mismatch(bf16) == ["dtype: 'float8_e4m3fn' here vs 'bfloat16' there"]
    assert fp8.layer_block_bytes * 2 == bf16.layer_block_bytes
    assert BlockLayout.from_dict(fp8.to_dict()) == fp8


def test_p2p_frames_carry_fp8_blocks_byte_for_byte():
    """The P/D transport's frames of an fp8 cache are its bytes, written back bit for bit."""
    wire = pytest.importorskip("engine_kvconnectors_p2p.wire")
    gen = torch.Generator().manual_seed(0)
    shape = (2, 2, 8, 16, 32)
    source = [torch.randn(shape, generator=gen).to(torch.float8_e4m3fn) for _ in range(2)]
    target = [torch.zeros(shape, dtype=torch.float8_e4m3fn) for _ in range(2)]
    frames = wire.block_frames(source, 2, [1, 5, 6])
    assert sum(len(f) for f in frames) == 2 * 3 * 2 * 2 * 16 * 32  # one byte a value
    wire.write_blocks(target, 2, (7, 2, 3), frames)
    for src, dst in zip(source, target):
        assert torch.equal(src[:, :, [1, 5, 6]].view(torch.uint8), dst[:, :, [7, 2, 3]].view(torch.uint8))
