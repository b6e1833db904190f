"""SamplingParams: what to generate and how, validated when built (field names as vLLM's).

Validation covers everything the step relies on that does not depend on the model: types,
ranges, and 64-bit limits on every integer (the transport is msgpack, the sampler's
tensors are int64). What needs the model (token ids below the vocabulary size,
:meth:`SamplingParams.check_vocab`) is checked by ``EngineCore.validate`` and the server.
What needs the tokenizer (``bad_words`` as token ids, :func:`tokenize_bad_words`) and the
context length (:func:`truncate_prompt`) is done by the front end that tokenizes the prompt."""

from __future__ import annotations

import math
import reprlib
from typing import Any, Literal

import attrs

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class InvalidParam(ValueError):
    """A bad sampling parameter; ``param`` names the field (OpenAI error's ``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


_short = reprlib.Repr()  # a 100k-entry stop list is not echoed whole
_short.maxstring = _short.maxother = 60


def _check(condition: bool, field: str, message: str, value) -> None:
    if not condition:
        raise InvalidParam(field, f"{field} {message}, got {_short.repr(value)}")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int64(value, field: str, optional: bool = False) -> None:
    """InvalidParam naming ``field`` unless ``value`` is an integer that fits 64 bits
    (signed), or None when ``optional``."""
    if optional and value is None:
        return
    _check(is_int(value) and INT64_MIN <= value <= INT64_MAX, field, "must be a 64-bit integer", value)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_float(value, field: str) -> None:
    _check(_finite(value), field, "must be a finite number", value)


MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: [-100, 100]


def _as_tuple(value):
    """A string is one entry, a list or tuple its entries; anything else is left for
    validation to reject with the field's name."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _as_optional_tuple(value):
    """None stays None (``allowed_token_ids`` unset is not "nothing allowed")."""
    return None if value is None else _as_tuple(value)


def _as_nested_tuple(value):
    """Token-id sequences (``bad_words_token_ids``): a list of lists, as msgpack returns it."""
    value = _as_tuple(value)
    return (
        tuple(_as_tuple(v) if isinstance(v, list) else v for v in value)
        if isinstance(value, tuple)
        else value
    )


def _token_ids_ok(ids) -> bool:
    return isinstance(ids, tuple) and all(is_int(t) and 0 <= t <= INT64_MAX for t in ids)


GrammarKind = Literal["json", "json_object", "regex", "grammar", "choice", "structural_tag"]


@attrs.frozen
class GrammarSpec:
    """A request's structured-output constraint (``SamplingParams.structured_outputs``), which a
    :class:`engine.interfaces.GrammarBackend` compiles."""

    kind: GrammarKind
    value: Any  # schema (str or dict), regex, EBNF text, list of choices, or structural tag (dict)


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
    stop: tuple[str, ...] = attrs.field(default=(), converter=_as_tuple)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_as_tuple)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n per generated token; -1: the whole vocabulary
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_as_optional_tuple)
    bad_words: tuple[str, ...] = attrs.field(default=(), converter=_as_tuple)
    # bad_words as token sequences, filled by tokenize_bad_words (the front end has the tokenizer)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = attrs.field(default=(), converter=_as_nested_tuple)
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens; -1: max_model_len
    structured_outputs: GrammarSpec | None = None
    extra_args: dict[str, Any] | None = None

    def __attrs_post_init__(self):
        self._check_types()
        _check(self.n >= 1, "n", "must be at least 1", self.n)
        _check(self.temperature >= 0, "temperature", "must be non-negative", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(self.top_k >= -1, "top_k", "must be -1 (off), 0 (off) or positive", self.top_k)
        _check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        _check(self.repetition_penalty > 0, "repetition_penalty", "must be positive", self.repetition_penalty)
        _check(
            -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            "must be in [-2, 2]",
            self.frequency_penalty,
        )
        _check(
            -2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]", self.presence_penalty
        )
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens",
            "must be at least 1",
            self.max_tokens,
        )
        _check(self.min_tokens >= 0, "min_tokens", "must be non-negative", self.min_tokens)
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must not exceed max_tokens",
            self.min_tokens,
        )
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            _check(
                value is None or value >= -1, field, "must be -1 (whole vocabulary) or non-negative", value
            )
        _check(all(s for s in self.stop), "stop", "must not contain empty strings", self.stop)
        _check(
            all(w.strip() for w in self.bad_words),
            "bad_words",
            "must not contain empty words",
            self.bad_words,
        )
        _check(
            self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
            "allowed_token_ids",
            "must not be empty",
            self.allowed_token_ids,
        )
        _check(
            all(-MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for b in (self.logit_bias or {}).values()),
            "logit_bias",
            f"values must be in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            self.logit_bias,
        )
        _check(
            self.truncate_prompt_tokens is None
            or self.truncate_prompt_tokens == -1
            or self.truncate_prompt_tokens >= 1,
            "truncate_prompt_tokens",
            "must be -1 or at least 1",
            self.truncate_prompt_tokens,
        )
        # n samples of one prompt are seeded seed, seed + 1, ... seed + n - 1
        _check(
            self.seed is None or self.seed + self.n - 1 <= INT64_MAX,
            "seed",
            f"plus n - 1 must fit 64 bits (at most {INT64_MAX})",
            self.seed,
        )

    def _check_types(self) -> None:
        for field in ("n", "top_k", "min_tokens"):
            check_int64(getattr(self, field), field)
        for field in ("seed", "max_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
            check_int64(getattr(self, field), field, optional=True)
        for field in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        ):
            _check_float(getattr(self, field), field)
        _check(
            isinstance(self.stop, tuple) and all(isinstance(s, str) for s in self.stop),
            "stop",
            "must be a string or a list of strings",
            self.stop,
        )
        _check(
            isinstance(self.stop_token_ids, tuple)
            and all(is_int(t) and 0 <= t <= INT64_MAX for t in self.stop_token_ids),
            "stop_token_ids",
            "must be a list of non-negative 64-bit integers",
            self.stop_token_ids,
        )
        _check(
            self.allowed_token_ids is None or _token_ids_ok(self.allowed_token_ids),
            "allowed_token_ids",
            "must be a list of non-negative 64-bit integers",
            self.allowed_token_ids,
        )
        _check(
            self.logit_bias is None
            or (
                isinstance(self.logit_bias, dict)
                and _token_ids_ok(tuple(self.logit_bias))
                and all(_finite(b) for b in self.logit_bias.values())
            ),
            "logit_bias",
            "must map token ids to finite numbers",
            self.logit_bias,
        )
        _check(
            isinstance(self.bad_words, tuple) and all(isinstance(w, str) for w in self.bad_words),
            "bad_words",
            "must be a list of strings",
            self.bad_words,
        )
        _check(
            isinstance(self.bad_words_token_ids, tuple)
            and all(_token_ids_ok(ids) and ids for ids in self.bad_words_token_ids),
            "bad_words_token_ids",
            "must be a list of non-empty token id lists",
            self.bad_words_token_ids,
        )
        _check(
            self.structured_outputs is None or isinstance(self.structured_outputs, GrammarSpec),
            "structured_outputs",
            "must be a GrammarSpec",
            self.structured_outputs,
        )
        _check(
            self.extra_args is None or isinstance(self.extra_args, dict),
            "extra_args",
            "must be a dict",
            self.extra_args,
        )

    def check_vocab(self, vocab_size: int) -> None:
        """InvalidParam naming the field unless every token id the request names is below
        ``vocab_size`` (the sampler indexes the logits with them)."""
        fields = {
            "stop_token_ids": self.stop_token_ids,
            "allowed_token_ids": self.allowed_token_ids or (),
            "logit_bias": tuple(self.logit_bias or ()),
            "bad_words": tuple(t for ids in self.bad_words_token_ids for t in ids),
        }
        for field, ids in fields.items():
            bad = [t for t in ids if t >= vocab_size]
            _check(not bad, field, f"must name token ids in [0, {vocab_size})", bad)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists, dicts, scalars) for a transport; ``from_dict`` inverts it."""
        return attrs.asdict(self)  # msgpack and JSON turn tuples into lists; the converters restore them

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        data = dict(data)
        unknown = set(data) - set(attrs.fields_dict(cls))
        _check(not unknown, "params", "has unknown fields", sorted(unknown))
        spec = data.get("structured_outputs")
        if spec is not None:
            _check(
                isinstance(spec, dict) and set(spec) == {"kind", "value"},
                "structured_outputs",
                "must be {kind, value}",
                spec,
            )
            data["structured_outputs"] = GrammarSpec(**spec)
        return cls(**data)

    @property
    def masks_tokens(self) -> bool:
        """Whether the sampler has a token mask or bias to apply (besides min_tokens)."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def tokenize_bad_words(params: SamplingParams, tokenizer) -> SamplingParams:
    """``params`` with ``bad_words_token_ids`` filled, as vLLM tokenizes them: each word
    alone, and with a leading space when that makes a different sequence of the same
    length (a word mid-text), so both spellings are banned. Called by the front end."""
    if not params.bad_words or params.bad_words_token_ids:
        return params
    sequences: list[tuple[int, ...]] = []
    for word in params.bad_words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if not alone:  # nothing the model could emit spells it
            continue
        sequences.append(alone)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return attrs.evolve(params, bad_words_token_ids=tuple(sequences))


def truncation_length(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """How many prompt tokens vLLM's ``truncate_prompt_tokens`` keeps: None (no cut) for None,
    ``max_model_len`` for -1; InvalidParam naming the field for anything but -1 or a count from
    1 to ``max_model_len`` (more is an error, as in vLLM). Generation keeps the last tokens
    (:func:`truncate_prompt`), pooling the first
    (:func:`engine.messages.pooling_params.pooling_token_ids`)."""
    if truncate_prompt_tokens is None:
        return None
    if not is_int(truncate_prompt_tokens) or not (
        truncate_prompt_tokens == -1 or truncate_prompt_tokens >= 1
    ):
        raise InvalidParam(
            "truncate_prompt_tokens",
            f"truncate_prompt_tokens must be -1 or at least 1, got {_short.repr(truncate_prompt_tokens)}",
        )
    if truncate_prompt_tokens > max_model_len:
        raise InvalidParam(
            "truncate_prompt_tokens",
            f"truncate_prompt_tokens value ({truncate_prompt_tokens}) is "
            f"greater than max_model_len ({max_model_len}); select a smaller truncation size",
        )
    return max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens


def truncate_prompt(
    prompt_token_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int
) -> list[int]:
    """The last ``truncate_prompt_tokens`` prompt tokens (vLLM's generation: left truncation;
    :func:`truncation_length` reads the value)."""
    keep = truncation_length(truncate_prompt_tokens, max_model_len)
    return prompt_token_ids if keep is None else prompt_token_ids[-keep:]
