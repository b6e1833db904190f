"""PoolingParams: what one request that pools (an embedding, a classification) asks for, with
vLLM's names; and a pooling input's token ids, cut as vLLM's ``truncate_prompt_tokens`` cuts
them for a pooling model (:func:`pooling_token_ids`)."""

from __future__ import annotations

import copy
import threading
import weakref
from typing import Any

import attrs

from engine.messages.sampling_params import InvalidParam, is_int

POOLING_TASKS = ("embed", "classify")


@attrs.frozen
class PoolingParams:
    """``task``: ``embed`` returns the pooled vector, ``classify`` the model's classification
    head over it as probabilities (a sigmoid for a one-label model such as a cross-encoder's
    relevance score, else a softmax over the labels), as vLLM's pooling tasks.
    ``normalize``: L2-normalise the pooled vector (None: the engine's pooler config says);
    ``dimensions``: keep the first ``dimensions`` values (matryoshka models only), normalised
    after the cut. Both are for ``embed``."""

    normalize: bool | None = None
    dimensions: int | None = None
    task: str = "embed"

    def __attrs_post_init__(self):
        if self.task not in POOLING_TASKS:
            raise InvalidParam("task", f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidParam("normalize", f"normalize must be a boolean, got {self.normalize!r}")
        if self.dimensions is not None and not (is_int(self.dimensions) and self.dimensions >= 1):
            raise InvalidParam(
                "dimensions", f"dimensions must be a positive integer, got {self.dimensions!r}"
            )

    def check_dimensions(self, hidden_size: int, matryoshka: bool, allowed: tuple[int, ...] | None) -> None:
        """InvalidParam naming ``dimensions`` unless the model can return that many: a
        matryoshka model (``is_matryoshka`` or ``matryoshka_dimensions`` in its config, as
        vLLM reads them), at most its hidden size, one of ``allowed`` when the config lists them."""
        d = self.dimensions
        if d is None:
            return
        if not matryoshka:
            raise InvalidParam(
                "dimensions",
                "dimensions: this model does not support matryoshka representation "
                "(its config sets neither is_matryoshka nor matryoshka_dimensions)",
            )
        if d > hidden_size:
            raise InvalidParam(
                "dimensions", f"dimensions: {d} exceeds the model's embedding size {hidden_size}"
            )
        if allowed and d not in allowed:
            raise InvalidParam(
                "dimensions",
                f"dimensions: {d} is not one of the model's matryoshka dimensions {list(allowed)}",
            )

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PoolingParams:
        unknown = set(data) - set(attrs.fields_dict(cls))
        if unknown:
            raise InvalidParam("params", f"pooling params: unknown fields {sorted(unknown)}")
        return cls(**data)


def matryoshka_of(hf_config) -> tuple[bool, tuple[int, ...] | None]:
    """(whether the model is matryoshka, the dimensions its config lists or None: any)."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    return bool(getattr(hf_config, "is_matryoshka", False) or dims), tuple(dims) if dims else None


def pooling_token_ids(tokenizer, text: str, pair: str | None = None, keep: int | None = None) -> list[int]:
    """A text's token ids as a pooling model reads them, or a pair's as one input as the
    model's tokenizer builds it (BERT: ``[CLS] A [SEP] B [SEP]``; a decoder's tokenizer: the
    two texts' tokens one after the other), cut to the first ``keep`` tokens when given. vLLM's
    pooling runner truncates on the right: the tokenizer cuts the text (of a pair, the longer
    text first) and keeps its special tokens, and a ``keep`` below their number cuts those too."""
    if keep is None:
        return list(tokenizer(text, pair)["input_ids"])
    truncating, lock = _truncating_copy(tokenizer)
    with lock:
        ids = truncating(text, pair, truncation=True, max_length=keep)["input_ids"]
    return list(ids)[:keep]


_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_COPIES_LOCK = threading.Lock()


def _truncating_copy(tokenizer) -> tuple[Any, threading.Lock]:
    """A private copy of ``tokenizer`` that truncates on the right, and the lock its calls
    take. A transformers fast tokenizer keeps truncation as state of its shared Rust tokenizer,
    set by each call: truncating with the front end's own tokenizer could cut another
    thread's untruncated prompt (or be undone by it mid-call)."""
    with _COPIES_LOCK:
        entry = _COPIES.get(tokenizer)
        if entry is None:
            truncating = copy.deepcopy(tokenizer)
            truncating.truncation_side = "right"
            entry = _COPIES[tokenizer] = (truncating, threading.Lock())
    return entry
