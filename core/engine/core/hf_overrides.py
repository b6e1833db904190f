"""vLLM's ``--hf-overrides``: keys set on the checkpoint's config before the model class is
chosen, so a checkpoint can be served as another architecture (a Qwen3 causal LM as
``Qwen3ForSequenceClassification``, the original Qwen3 reranker's vLLM recipe).

A config's ``classifier_from_token`` (vLLM's: the tokens whose logits make a classifier, such
as ``["no", "yes"]``) is resolved here to ``classifier_from_token_ids`` with the tokenizer,
since a model plugin is handed the config and never the tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def apply_hf_overrides(hf_config, overrides: dict[str, Any] | None, tokenizer: Callable[[], Any]) -> None:
    """Set ``overrides`` on ``hf_config`` (in place) and resolve its classifier tokens with
    ``tokenizer()`` (called only then: most configs have none, and loading a tokenizer takes a
    moment of start-up); ValueError naming the option for an unknown token or a tokenizer-less model."""
    for key, value in (overrides or {}).items():
        setattr(hf_config, key, value)
    tokens = getattr(hf_config, "classifier_from_token", None)
    if not tokens:
        return
    tokenizer = tokenizer()
    if tokenizer is None:
        raise ValueError("hf_overrides: classifier_from_token needs the model's tokenizer, and it has none")
    ids = []
    for token in tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ValueError(
                f"hf_overrides: classifier_from_token {token!r} is not a token of the model's vocabulary"
            )
        ids.append(int(token_id))
    hf_config.classifier_from_token_ids = ids
