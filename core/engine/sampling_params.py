"""SamplingParams: what to generate and how, validated when built (field names as vLLM's)."""

from __future__ import annotations

from typing import Any

import attrs

from engine.interfaces.grammar import GrammarSpec


class InvalidParam(ValueError):
    """A bad sampling parameter; ``param`` names the field (OpenAI error's ``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _check(condition: bool, field: str, message: str, value) -> None:
    if not condition:
        raise InvalidParam(field, f"{field} {message}, got {value!r}")


@attrs.frozen
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: tuple[str, ...] = attrs.field(default=(), converter=lambda s: (s,) if isinstance(s, str) else tuple(s or ()))
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=lambda s: tuple(s or ()))
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n per generated token; -1: the whole vocabulary
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: GrammarSpec | None = None
    extra_args: dict[str, Any] | None = None

    def __attrs_post_init__(self):
        _check(self.n >= 1, "n", "must be at least 1", self.n)
        _check(self.temperature >= 0, "temperature", "must be non-negative", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(self.top_k >= -1, "top_k", "must be -1 (off), 0 (off) or positive", self.top_k)
        _check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        _check(self.repetition_penalty > 0, "repetition_penalty", "must be positive", self.repetition_penalty)
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]", self.frequency_penalty)
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]", self.presence_penalty)
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1", self.max_tokens)
        _check(self.min_tokens >= 0, "min_tokens", "must be non-negative", self.min_tokens)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               "must not exceed max_tokens", self.min_tokens)
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            _check(value is None or value >= -1, field, "must be -1 (whole vocabulary) or non-negative", value)
        _check(all(s for s in self.stop), "stop", "must not contain empty strings", self.stop)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists, dicts, scalars) for a transport; ``from_dict`` inverts it."""
        return attrs.asdict(self)  # msgpack and JSON turn tuples into lists; the converters restore them

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        data = dict(data)
        if data.get("structured_outputs") is not None:
            data["structured_outputs"] = GrammarSpec(**data["structured_outputs"])
        return cls(**data)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)
