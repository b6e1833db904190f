"""One sampled sequence as its front end sees it, fed the core's :class:`Delta` messages: its
tokens, its text (incremental, never splitting a character, never handing out part of a stop
string), its logprob entries and how it ended. ``LLM`` and the server keep the same one."""

from __future__ import annotations

from engine.client.detokenizer import IncrementalDetokenizer
from engine.client.protocol import Delta
from engine.messages.sampling_params import SamplingParams


class SequenceOutput:
    def __init__(self, request_id: str, index: int, tokenizer, params: SamplingParams, request=None):
        """``index``: the sample's place among its front end's sequences; ``request``: the
        :class:`~engine.client.output_processor.RequestState` (prompt and samples) it is one of."""
        self.request_id, self.index, self.params, self.request = request_id, index, params, request
        self.detok = IncrementalDetokenizer(tokenizer, params)
        self.token_ids: list[int] = []
        self.logprobs: list[tuple] = []  # (ids, logprobs, ranks) per token, chosen first, when asked for
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token or string, or an error's message
        self.num_cached_tokens = 0  # prompt tokens the prefix cache held
        self.num_draft_tokens = self.num_accepted_tokens = 0  # speculative drafts verified, accepted
        self.kv_transfer_params: dict | None = None  # what the KV connector handed on at the finish (P/D)
        self._sent = 0  # characters of text handed out

    def feed(self, delta: Delta) -> tuple[str, list[tuple]]:
        """Take one step's delta; return the text now safe to hand out and the new logprob
        entries. A finished sequence takes nothing more."""
        if self.finish_reason is not None:
            return "", []
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        self.num_draft_tokens, self.num_accepted_tokens = delta.num_draft_tokens, delta.num_accepted_tokens
        entries = self._append(delta)
        if self.finish_reason is None and delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.error or delta.stop_reason
        if delta.kv_transfer_params is not None:
            self.kv_transfer_params = delta.kv_transfer_params
        return self._take_text(), entries

    def _append(self, delta: Delta) -> list[tuple]:
        """The delta's tokens up to the one that completes a stop string (which finishes it)."""
        entries = []
        for i, token in enumerate(delta.token_ids):
            self.token_ids.append(token)
            if delta.logprobs:
                entries.append(delta.logprobs[i])
            if self.detok.push([token]) is not None:
                self.finish_reason, self.stop_reason = "stop", self.detok.stop_string
                break
        self.logprobs += entries
        return entries

    def _take_text(self) -> str:
        text = self.detok.text
        end = len(text) if self.finish_reason else max(self._sent, len(text) - self.detok.pending_hold)
        new, self._sent = text[self._sent : end], end
        return new

    @property
    def hit_stop_string(self) -> bool:
        return self.detok.stop_string is not None

    @property
    def text(self) -> str:
        return self.detok.text

    @property
    def emitted(self) -> int:
        """Characters of text handed out so far."""
        return self._sent
