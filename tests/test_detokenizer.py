"""Incremental detokenization on the default model's byte-level BPE tokenizer: no step emits
a broken character, and the streamed text equals a one-shot decode."""

from __future__ import annotations

import copy
import random

import pytest

from engine.client import detokenizer
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


@pytest.mark.parametrize("skip_special", [True, False])
def test_the_backend_decodes_windows_as_the_tokenizer_does(default_tokenizer, skip_special):
    """The default tokenizer takes the Rust backend's decode: on random windows of ids, special
    tokens and bytes that end mid-character among them, the very string ``decode`` gives."""
    assert detokenizer._plain_backend(default_tokenizer) is default_tokenizer.backend_tokenizer
    decode = detokenizer.window_decoder(default_tokenizer, skip_special)
    rng = random.Random(0)
    specials = default_tokenizer.all_special_ids
    for _ in range(300):
        ids = [
            rng.choice(specials) if rng.random() < 0.2 else rng.randrange(len(default_tokenizer))
            for _ in range(7)
        ]
        assert decode(ids) == default_tokenizer.decode(ids, skip_special_tokens=skip_special)


def test_a_tokenizer_whose_decode_does_more_keeps_its_decode(default_tokenizer):
    """Spaces cleaned up, or a decode of its own: the tokenizer's ``decode`` is called."""
    cleaning = copy.deepcopy(default_tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    assert detokenizer._plain_backend(cleaning) is None

    class Shouting(type(default_tokenizer)):
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    shouting = copy.deepcopy(default_tokenizer)
    shouting.__class__ = Shouting
    assert detokenizer._plain_backend(shouting) is None
    detok = IncrementalDetokenizer(shouting, SamplingParams())
    for token in shouting.encode("quiet words"):
        detok.push([token])
    assert detok.text == "QUIET WORDS"


def test_a_tokenizer_of_another_library_keeps_its_decode():
    class Letters:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(ord("a") + i) for i in ids)

    assert detokenizer._plain_backend(Letters()) is None
    detok = IncrementalDetokenizer(Letters(), SamplingParams())
    for token in (0, 1, 2):
        detok.push([token])
    assert detok.text == "abc"
