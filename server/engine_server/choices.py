"""One sampled sequence of an HTTP request: incremental text that never splits a character
and never streams part of a stop string, plus its logprobs in OpenAI's two formats."""

from __future__ import annotations

from engine.detokenizer import IncrementalDetokenizer
from engine_server.protocol import Delta

LOGPROB_FLOOR = -9999.0  # what a masked-out token (-inf, e.g. under a grammar) reports, as vLLM


def _finite(logprob: float) -> float:
    """JSON has no -inf or NaN: a token the sampler ruled out gets the floor."""
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # noqa: FURB136 (max() keeps NaN)


class Choice:
    def __init__(self, index: int, request_id: str, tokenizer, params, tokens_as_ids: bool = False):
        """``tokens_as_ids``: logprob tokens are ``"token_id:N"`` (``return_tokens_as_token_ids``),
        for clients that need tokens which do not decode to text on their own."""
        self.index = index
        self.request_id = request_id
        self.tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(tokenizer, params)
        self.token_ids: list[int] = []
        self.logprobs: list[tuple] = []  # (ids, logprobs, ranks), chosen token first
        self.prompt_entries: list[tuple] = []  # the same for prompt positions 1.. (prompt_logprobs)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0  # prompt tokens the prefix cache held
        self.kv_transfer_params: dict | None = None  # what the KV connector handed on at the finish (P/D)
        self.tokens_as_ids = tokens_as_ids
        self._sent = 0  # characters of text already handed out

    def feed(self, delta: Delta) -> tuple[str, list[tuple]]:
        """Take one step's tokens; return the text now safe to emit and their logprobs."""
        if delta.prompt_logprobs:
            self.prompt_entries += delta.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        entries = []
        for i, token in enumerate(delta.token_ids):
            self.token_ids.append(token)
            if delta.logprobs:
                entries.append(delta.logprobs[i])
            if self.detok.push([token]) is not None:
                self.finish_reason, self.stop_reason = "stop", self.detok.stop_string
                break
        if self.finish_reason is None and delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.error or delta.stop_reason
        if delta.kv_transfer_params is not None:
            self.kv_transfer_params = delta.kv_transfer_params
        self.logprobs += entries
        return self._take_text(), entries

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

    def _take_text(self) -> str:
        text = self.detok.text
        end = len(text) if self.finish_reason else max(self._sent, len(text) - self.detok.pending_hold)
        new, self._sent = text[self._sent:end], end
        return new

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _logprob_token(self, token: int) -> str:
        return f"token_id:{token}" if self.tokens_as_ids else self._token_text(token)

    def completion_logprobs(self, entries: list[tuple], text_offset: int) -> dict:
        """``/v1/completions`` format: parallel lists plus the top-n dict per position."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for ids, lps, _ in entries:
            piece = self._logprob_token(ids[0])
            tokens.append(piece)
            token_logprobs.append(_finite(lps[0]))
            top.append({self._logprob_token(t): _finite(lp) for t, lp in zip(ids[1:], lps[1:])})
            offsets.append(text_offset)
            text_offset += len(piece)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def echo_logprobs(self, prompt_ids: list[int]) -> dict:
        """The prompt's own tokens in the ``/v1/completions`` format, the first without a
        log-prob (nothing precedes it), as vLLM returns them for ``echo`` + ``logprobs``."""
        first = self._logprob_token(prompt_ids[0])
        echo = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
        rest = self.completion_logprobs(self.prompt_entries, len(first))
        return {key: echo[key] + rest[key] for key in echo}

    def prompt_logprobs(self) -> list[dict | None]:
        """vLLM's ``prompt_logprobs``: None for the first prompt token, then per position the
        prompt's token and the top alternatives, by token id."""
        return [None] + [{str(t): {"logprob": lp, "rank": rank, "decoded_token": self._token_text(t)}
                          for t, lp, rank in zip(ids, lps, ranks)} for ids, lps, ranks in self.prompt_entries]

    def chat_logprobs(self, entries: list[tuple]) -> dict:
        """``/v1/chat/completions`` format: one object per token with its top alternatives."""
        def item(token: int, logprob: float) -> dict:
            piece = self._logprob_token(token)
            return {"token": piece, "logprob": _finite(logprob), "bytes": list(piece.encode("utf-8"))}

        return {"content": [{**item(ids[0], lps[0]),
                             "top_logprobs": [item(t, lp) for t, lp in zip(ids[1:], lps[1:])]}
                            for ids, lps, _ in entries]}
