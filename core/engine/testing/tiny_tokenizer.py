"""A tiny byte-level BPE tokenizer built in code, for kits that need a real tokenizer without
a model: every text encodes (256 byte tokens, as GPT-2-style tokenizers have), a few merges
give multi-character tokens that straddle the boundaries grammars care about (``'":'``,
``'"}'``, ``"deep"``, ``" blue"``), and one special token is the EOS.

It is a ``transformers`` fast tokenizer, the kind the engine hands plugins
(``GrammarContext.tokenizer``), so a backend sees what it sees with a real model."""

from __future__ import annotations

from functools import cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

EOS = "<|end|>"
# Each piece becomes one token (with a token for each of its prefixes, as BPE merges build them).
PIECES = (
    "deep",
    " blue",
    " sea",
    "red",
    "green",
    "blue",
    "true",
    "false",
    "null",
    "name",
    "tags",
    '{"',
    '":',
    '": "',
    '", "',
    '"}',
    '"]',
    '["',
    "}, ",
    "], ",
    ", ",
    "ab",
    "abc",
    "-1",
    "12",
    "(1",
    "9)",
    "0.5",
)


@cache
def tiny_tokenizer():
    """The kit's tokenizer (one per process: backends may key caches on it)."""
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = []
    for piece in PIECES:
        [(chars, _)] = byte_level.pre_tokenize_str(piece)
        for end in range(2, len(chars) + 1):
            if chars[:end] not in vocab:
                merges.append((chars[: end - 1], chars[end - 1]))
                vocab[chars[:end]] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS)
