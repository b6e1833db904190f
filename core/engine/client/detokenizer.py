"""Incremental detokenization with stop strings.

Text is decoded over a sliding window (the last few tokens before the unread ones), so
each step costs O(window), and a step whose text would end in a partial multi-byte
character (U+FFFD) emits nothing until the character completes. Stop strings are
searched in the new text plus enough of the old to catch one that straddles a step;
``pending_hold`` tells a streaming front end how many trailing characters might still
become a stop string and must be held back.
"""

from __future__ import annotations

_WINDOW = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, params):
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix = 0  # window start
        self._read = 0  # tokens already turned into text
        self.stop_string: str | None = None

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

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
