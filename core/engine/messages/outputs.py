"""User-facing results of the offline API (vLLM's names and shapes)."""

from __future__ import annotations

import attrs


@attrs.frozen
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


# one dict per position: token id -> Logprob (the chosen token and the top-n)
PositionLogprobs = dict[int, Logprob]


@attrs.define
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_draft_tokens: int = 0  # speculative drafts verified for this sequence, and accepted
    num_accepted_tokens: int = 0

    def finished(self) -> bool:
        return self.finish_reason is not None


@attrs.define
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0


@attrs.define
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@attrs.define
class EmbeddingRequestOutput:
    """One prompt's result of ``LLM.embed`` (vLLM's shape: ``out.outputs.embedding``)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@attrs.define
class ClassificationOutput:
    probs: list[float]  # one per label, in the model's label order

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@attrs.define
class ClassificationRequestOutput:
    """One prompt's result of ``LLM.classify`` (vLLM's shape: ``out.outputs.probs``)."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@attrs.define
class ScoringOutput:
    score: float


@attrs.define
class ScoringRequestOutput:
    """One pair's result of ``LLM.score`` (vLLM's shape: ``out.outputs.score``); its prompt
    tokens are the pair's (a cross-encoder's one input, or both texts' for an embedding model)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
