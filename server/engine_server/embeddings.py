"""`/v1/embeddings`: OpenAI's embeddings route over the engine's pooling runner. Every input
(a string, a list of strings, a list of token ids or a list of such lists) becomes one engine
request, all submitted together so the engine pools them in the same steps; the vectors come
back as little-endian float32 bytes and are sent as JSON floats or, with
``encoding_format: "base64"``, as those bytes in base64 (what OpenAI sends)."""

from __future__ import annotations

import base64
import uuid

from starlette.requests import Request
from starlette.responses import Response

from engine.messages.pooling_params import PoolingParams
from engine.messages.sampling_params import InvalidParam
from engine_server.bounds import json_response
from engine_server.errors import bad_request
from engine_server.generation import check_model, check_runner
from engine_server.pooling import floats, kept_tokens, list_body, pool, prompt_tokens
from engine_server.prompts import check_prompt, completion_prompts
from engine_server.schemas import EmbeddingRequest
from engine_server.validation import decode_body


class Embedding:
    """One HTTP request's inputs, validated and tokenized off the event loop."""

    def __init__(self, state, body: EmbeddingRequest):
        check_model(state, body.model)
        check_runner(state, "pooling")
        self.state, self.body = state, body
        self.id = f"embd-{uuid.uuid4().hex}"
        params = PoolingParams(normalize=body.normalize, dimensions=body.dimensions)
        try:
            params.check_dimensions(
                state.embedding_size, state.matryoshka, tuple(state.matryoshka_dimensions or ()) or None
            )
        except InvalidParam as exc:
            raise bad_request(str(exc), exc.param) from None
        keep = kept_tokens(state, body.truncate_prompt_tokens)
        prompts = [ids for _, ids in completion_prompts(state, body.input, 1, "input", keep)]
        for ids in prompts:
            check_prompt(state, ids, None, "input", generates=False)
        self.children = [(f"{self.id}-{i}", ids, params) for i, ids in enumerate(prompts)]

    async def run(self, request: Request) -> Response:
        vectors = await pool(self.state, request, self.id, self.children, self.body.priority, "input")
        entries = len(self.children) * max(1, self.state.embedding_size)
        return await json_response(self.state, lambda: self._body(vectors), entries)

    def _body(self, vectors: dict[str, bytes]) -> dict:
        data = []
        for index, (rid, _, _) in enumerate(self.children):
            raw = vectors[rid]
            value = (
                base64.b64encode(raw).decode()
                if self.body.encoding_format == "base64"
                else floats(raw).tolist()
            )
            data.append({"object": "embedding", "index": index, "embedding": value})
        return list_body(self.id, self.state.model_name, data, prompt_tokens(self.children))


def prepare_embedding(state, data: bytes) -> Embedding:
    return Embedding(state, decode_body(data, EmbeddingRequest, state.allow_unknown_fields))


async def embeddings(request: Request) -> Response:
    state = request.app.state.server
    data = await state.read(request)
    embedding = await state.offload(prepare_embedding, state, data)
    return await embedding.run(request)
