"""Incremental detokenization on the default model's byte-level BPE tokenizer: no step emits
a broken character, and the streamed text equals a one-shot decode."""

from __future__ import annotations

import pytest

from engine.client.detokenizer import IncrementalDetokenizer
from engine.messages.sampling_params import SamplingParams

TEXTS = [
    "Hello world, plain ASCII.",
    "Emoji: 👩‍👩‍👧‍👦 family, 🚀 rocket, 🤖🤖 robots!",
    "中文测试：你好，世界。日本語のテキスト、한국어 문장.",
    "Mixed: café naïve façade — “quotes” … ½ ∑ ∞ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "  leading spaces, tabs\tand\nnew lines\n\n",
]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_one_shot_and_never_splits_a_character(default_tokenizer, text):
    ids = default_tokenizer.encode(text)
    detok = IncrementalDetokenizer(default_tokenizer, SamplingParams())
    seen = ""
    for token in ids:
        detok.push([token])
        assert "\ufffd" not in detok.text, f"broken character after token {token}"
        assert detok.text.startswith(seen)
        seen = detok.text
    assert detok.text == default_tokenizer.decode(ids, skip_special_tokens=True) == text


def test_stop_string_across_tokens_and_hold_back(default_tokenizer):
    ids = default_tokenizer.encode("The answer is 42. END of story")
    detok = IncrementalDetokenizer(default_tokenizer, SamplingParams(stop=["END"]))
    assert detok.pending_hold == 2
    stop = None
    for token in ids:
        stop = detok.push([token]) or stop
        if stop:
            break
    assert stop == "END" and detok.text == "The answer is 42. "
