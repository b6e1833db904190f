"""Incremental detokenization with stop strings.

Text is decoded over a sliding window (the last few tokens before the unread ones), so
each step costs O(window), and a step whose text would end in a partial multi-byte
character (U+FFFD) emits nothing until the character completes. Stop strings are
searched in the new text plus enough of the old to catch one that straddles a step;
``pending_hold`` tells a streaming front end how many trailing characters might still
become a stop string and must be held back.

A ``transformers`` fast tokenizer is decoded by its Rust backend directly where that is what
its ``decode`` would do (no clean-up of spaces, neither method overridden): the wrapper's own
work per call (argument conversion, keyword handling) took ~2/3 of a window's 2.5 µs, twice a
token for every sequence of a step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

_WINDOW = 6


def window_decoder(tokenizer, skip_special: bool) -> Callable[[list[int]], str]:
    """``ids -> tokenizer.decode(ids, skip_special_tokens=skip_special)``, the same string."""
    backend = _plain_backend(tokenizer)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special)


def _plain_backend(tokenizer):
    """The Rust tokenizer that a ``transformers`` fast tokenizer's ``decode`` reduces to, or None
    where its decode does more (cleans up spaces, is overridden) or it is no such tokenizer."""
    transformers = sys.modules.get("transformers")  # not imported: no such tokenizer exists here
    if transformers is None:
        return None
    base, kind = transformers.PreTrainedTokenizerFast, type(tokenizer)
    if not isinstance(tokenizer, base) or tokenizer.clean_up_tokenization_spaces:
        return None
    if kind.decode is not base.decode or kind._decode is not base._decode:
        return None
    return tokenizer.backend_tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer, params):
        self.tokenizer = tokenizer
        self._decode = None if tokenizer is None else window_decoder(tokenizer, params.skip_special_tokens)
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix = 0  # window start
        self._read = 0  # tokens already turned into text
        self.stop_string: str | None = None

    def push(self, token_ids: list[int]) -> str | None:
        """Add tokens; return the stop string they completed, if any (text is cut there)."""
        if self.tokenizer is None:
            return None
        self.token_ids += token_ids
        before = self._decode(self.token_ids[self._prefix : self._read])
        after = self._decode(self.token_ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return None
        new = after[len(before) :]
        self._prefix = max(self._read, len(self.token_ids) - _WINDOW)
        self._read = len(self.token_ids)
        old_len = len(self.text)
        self.text += new
        return self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> str | None:
        for stop in self.stop:
            start = max(0, old_len - len(stop) + 1)
            index = self.text.find(stop, start)
            if index != -1:
                self.text = self.text[: index + (len(stop) if self.include_stop else 0)]
                self.stop_string = stop
                return stop
        return None

    @property
    def pending_hold(self) -> int:
        """Trailing characters a stream must hold back: the longest stop-string prefix."""
        return max((len(s) - 1 for s in self.stop), default=0)
