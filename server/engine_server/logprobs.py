"""OpenAI's logprob formats of a sequence's logprob entries (the engine's (token ids, logprobs,
ranks), chosen token first): ``/v1/completions``' parallel lists, ``/v1/chat/completions``'
objects, the echoed prompt's and vLLM's ``prompt_logprobs``."""

from __future__ import annotations

from engine.client import RequestState

LOGPROB_FLOOR = -9999.0  # what a masked-out token (-inf, e.g. under a grammar) reports, as vLLM


def _finite(logprob: float) -> float:
    """JSON has no -inf or NaN: a token the sampler ruled out gets the floor."""
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # noqa: FURB136 (max() keeps NaN)


class LogprobFormat:
    def __init__(self, tokenizer, tokens_as_ids: bool = False):
        """``tokens_as_ids``: logprob tokens are ``"token_id:N"`` (``return_tokens_as_token_ids``),
        for clients that need tokens which do not decode to text on their own."""
        self.tokenizer = tokenizer
        self.tokens_as_ids = tokens_as_ids

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
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def echo_logprobs(self, request: RequestState) -> dict:
        """The prompt's own tokens in the ``/v1/completions`` format, the first without a
        log-prob (nothing precedes it), as vLLM returns them for ``echo`` + ``logprobs``."""
        first = self._logprob_token(request.prompt_token_ids[0])
        echo = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
        rest = self.completion_logprobs(request.prompt_logprobs, len(first))
        return {key: echo[key] + rest[key] for key in echo}

    def prompt_logprobs(self, request: RequestState) -> list[dict | None]:
        """vLLM's ``prompt_logprobs``: None for the first prompt token, then per position the
        prompt's token and the top alternatives, by token id."""
        return [None] + [
            {
                str(t): {"logprob": _finite(lp), "rank": rank, "decoded_token": self._token_text(t)}
                for t, lp, rank in zip(ids, lps, ranks)
            }
            for ids, lps, ranks in request.prompt_logprobs
        ]

    def chat_logprobs(self, entries: list[tuple]) -> dict:
        """``/v1/chat/completions`` format: one object per token with its top alternatives."""

        def item(token: int, logprob: float) -> dict:
            piece = self._logprob_token(token)
            return {"token": piece, "logprob": _finite(logprob), "bytes": list(piece.encode("utf-8"))}

        return {
            "content": [
                {**item(ids[0], lps[0]), "top_logprobs": [item(t, lp) for t, lp in zip(ids[1:], lps[1:])]}
                for ids, lps, _ in entries
            ]
        }
