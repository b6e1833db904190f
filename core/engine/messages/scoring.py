"""How vLLM's score task pairs texts and scores them, for the offline ``LLM.score`` and the
server's ``/score`` and ``/rerank``: one first text against many (1:N) or texts zipped pairwise
(N:N); a cross-encoder (a classifier with one label) scores a pair as one input, tokenized as a
pair by its tokenizer (:func:`engine.messages.pooling_params.pooling_token_ids`), and an
embedding model scores it as the cosine similarity of the two texts' embeddings."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.messages.sampling_params import InvalidParam


def score_pairs(
    first: str | Sequence[str], second: str | Sequence[str], names: tuple[str, str] = ("text_1", "text_2")
) -> list[tuple[str, str]]:
    """(first, second) text pairs: a single first text against every second (1:N), else both
    lists zipped (N:N); InvalidParam naming the field (``names``) for an empty or mismatched list."""
    firsts = [first] if isinstance(first, str) else list(first)
    seconds = [second] if isinstance(second, str) else list(second)
    for name, texts in zip(names, (firsts, seconds)):
        if not texts:
            raise InvalidParam(name, f"{name}: give at least one text")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise InvalidParam(
            names[1],
            f"{names[1]}: {len(seconds)} texts for {len(firsts)} in {names[0]}; "
            f"give one {names[0]} or as many as {names[1]}",
        )
    return list(zip(firsts, seconds))


def scores_by_cross_encoder(labels: list[str]) -> bool:
    """Whether a model with these classifier ``labels`` scores pairs as one input (a
    cross-encoder: one label) or by embedding cosine (no labels); ValueError for a classifier
    of several labels, which has no single relevance score (vLLM refuses it too)."""
    if len(labels) > 1:
        raise ValueError(
            f"this model classifies into {len(labels)} labels and has no relevance score; "
            "score and rerank need a cross-encoder (one label) or an embedding model"
        )
    return len(labels) == 1


def cosine(first, second) -> float:
    """Cosine similarity of two embeddings (float sequences or arrays)."""
    a, b = (np.asarray(vector, dtype=np.float64) for vector in (first, second))
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))
