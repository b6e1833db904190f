"""vLLM's ``/score`` and ``/rerank`` over the pooling runner (:mod:`engine.messages.scoring`):
a cross-encoder scores each (first, second) pair as one input, tokenized as a pair by its
tokenizer, with its classification head (a relevance score in [0, 1]); an embedding model
scores a pair by the cosine similarity of the two texts' embeddings (each distinct text
embedded once). ``/rerank`` scores one query against documents and returns them by relevance,
as Jina's and Cohere's rerank APIs do."""

from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.responses import Response

from engine.messages.pooling_params import PoolingParams, pooling_token_ids
from engine.messages.sampling_params import InvalidParam
from engine.messages.scoring import cosine, score_pairs, scores_by_cross_encoder
from engine_server.bounds import json_response
from engine_server.errors import bad_request
from engine_server.generation import check_model, check_runner
from engine_server.pooling import floats, kept_tokens, list_body, pool, prompt_tokens
from engine_server.prompts import check_fanout, check_prompt
from engine_server.schemas import RerankDocument, RerankRequest, ScoreRequest
from engine_server.validation import decode_body

SPELLINGS = (("text_1", "text_2"), ("queries", "documents"), ("data_1", "data_2"))


class Scores:
    """One HTTP request's pairs, validated and tokenized off the event loop, and their scores;
    ``truncate`` (``truncate_prompt_tokens``) cuts each engine input to its first k tokens (a
    cross-encoder's pair as its tokenizer truncates a pair: the longer text first), as vLLM."""

    def __init__(
        self,
        state,
        body: ScoreRequest | RerankRequest,
        first,
        second,
        names: tuple[str, str],
        kind: str = "score",
    ):
        check_model(state, body.model)
        check_runner(state, "pooling")
        keep = kept_tokens(state, body.truncate_prompt_tokens)
        self.state = state
        try:
            self.pairs = score_pairs(first, second, names)
            self.cross_encoder = scores_by_cross_encoder(state.classifier_labels)
        except InvalidParam as exc:
            raise bad_request(str(exc), exc.param) from None
        except ValueError as exc:
            raise bad_request(str(exc), "model") from None
        for name, texts in zip(names, zip(*self.pairs)):
            if not all(texts):
                raise bad_request(f"{name} must not hold an empty text", name)
        self.id = f"{kind}-{uuid.uuid4().hex}"
        # a cross-encoder's engine requests are the pairs, an embedding model's the distinct texts
        self.texts = [] if self.cross_encoder else list(dict.fromkeys(t for pair in self.pairs for t in pair))
        check_fanout(state, len(self.texts or self.pairs), 1, names[1])
        if self.cross_encoder:
            prompts = [pooling_token_ids(state.tokenizer, a, b, keep) for a, b in self.pairs]
            params = PoolingParams(task="classify")
        else:
            prompts = [pooling_token_ids(state.tokenizer, text, keep=keep) for text in self.texts]
            params = PoolingParams()
        for ids in prompts:
            check_prompt(state, ids, None, names[1], generates=False)
        self.children = [(f"{self.id}-{i}", ids, params) for i, ids in enumerate(prompts)]
        self.param = names[1]

    async def run(self, request: Request, priority: int) -> tuple[list[float], int]:
        """Each pair's score, in order, and the prompt tokens they took."""
        vectors = await pool(self.state, request, self.id, self.children, priority, self.param)
        ordered = [floats(vectors[rid]) for rid, _, _ in self.children]
        if self.cross_encoder:
            scores = [float(probs[0]) for probs in ordered]
        else:
            by_text = dict(zip(self.texts, ordered))
            scores = [cosine(by_text[a], by_text[b]) for a, b in self.pairs]
        return scores, prompt_tokens(self.children)


def prepare_score(state, data: bytes) -> tuple[ScoreRequest, Scores]:
    body = decode_body(data, ScoreRequest, state.allow_unknown_fields)
    given = [
        names
        for names in SPELLINGS
        if getattr(body, names[0]) is not None or getattr(body, names[1]) is not None
    ]
    if len(given) != 1:
        raise bad_request(
            "give the pairs as text_1 and text_2 (or queries and documents, or data_1 and data_2), "
            "one of the three spellings",
            "text_1",
        )
    names = given[0]
    first, second = (getattr(body, name) for name in names)
    for name, value in zip(names, (first, second)):
        if value is None:
            raise bad_request(f"{name} is required with {names[0] if name == names[1] else names[1]}", name)
    return body, Scores(state, body, first, second, names)


async def score(request: Request) -> Response:
    state = request.app.state.server
    data = await state.read(request)
    body, scores = await state.offload(prepare_score, state, data)
    values, tokens = await scores.run(request, body.priority)

    def build() -> dict:
        data = [{"index": i, "object": "score", "score": value} for i, value in enumerate(values)]
        return list_body(scores.id, state.model_name, data, tokens)

    return await json_response(state, build, len(values))


def prepare_rerank(state, data: bytes) -> tuple[RerankRequest, list[str], Scores]:
    body = decode_body(data, RerankRequest, state.allow_unknown_fields)
    documents = [doc.text if isinstance(doc, RerankDocument) else doc for doc in body.documents]
    return body, documents, Scores(state, body, body.query, documents, ("query", "documents"), "rerank")


async def rerank(request: Request) -> Response:
    state = request.app.state.server
    data = await state.read(request)
    body, documents, scores = await state.offload(prepare_rerank, state, data)
    values, tokens = await scores.run(request, body.priority)
    ranked = sorted(range(len(values)), key=lambda i: values[i], reverse=True)
    ranked = ranked[: body.top_n] if body.top_n else ranked

    def build() -> dict:
        results = []
        for index in ranked:
            result: dict = {"index": index, "relevance_score": values[index]}
            if body.return_documents:
                result["document"] = {"text": documents[index]}
            results.append(result)
        return {
            "id": scores.id,
            "model": state.model_name,
            "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    return await json_response(state, build, len(ranked))
