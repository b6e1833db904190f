"""vLLM's ``/classify``: each input's label probabilities from a sequence-classification
model (a softmax over its labels; the sigmoid of a one-label model's logit), with the most
probable label's name from the checkpoint's ``id2label``."""

from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.responses import Response

from engine.messages.pooling_params import PoolingParams
from engine_server.bounds import json_response
from engine_server.errors import bad_request
from engine_server.generation import check_model, check_runner
from engine_server.pooling import floats, kept_tokens, list_body, pool, prompt_tokens
from engine_server.prompts import check_prompt, completion_prompts
from engine_server.schemas import ClassificationRequest
from engine_server.validation import decode_body


class Classification:
    """One HTTP request's inputs, validated and tokenized off the event loop."""

    def __init__(self, state, body: ClassificationRequest):
        check_model(state, body.model)
        check_runner(state, "pooling")
        if not state.classifier_labels:
            raise bad_request(
                "this model has no classification head (it embeds); /classify needs a "
                "sequence-classification model",
                "model",
            )
        self.state, self.body = state, body
        self.id = f"classify-{uuid.uuid4().hex}"
        keep = kept_tokens(state, body.truncate_prompt_tokens)
        prompts = [ids for _, ids in completion_prompts(state, body.input, 1, "input", keep)]
        for ids in prompts:
            check_prompt(state, ids, None, "input", generates=False)
        params = PoolingParams(task="classify")
        self.children = [(f"{self.id}-{i}", ids, params) for i, ids in enumerate(prompts)]

    async def run(self, request: Request) -> Response:
        vectors = await pool(self.state, request, self.id, self.children, self.body.priority, "input")
        entries = len(self.children) * len(self.state.classifier_labels)
        return await json_response(self.state, lambda: self._body(vectors), entries)

    def _body(self, vectors: dict[str, bytes]) -> dict:
        labels = self.state.classifier_labels
        data = []
        for index, (rid, _, _) in enumerate(self.children):
            probs = floats(vectors[rid])
            label = labels[int(probs.argmax())]
            data.append({"index": index, "label": label, "probs": probs.tolist(), "num_classes": len(probs)})
        return list_body(self.id, self.state.model_name, data, prompt_tokens(self.children))


def prepare_classification(state, data: bytes) -> Classification:
    return Classification(state, decode_body(data, ClassificationRequest, state.allow_unknown_fields))


async def classify(request: Request) -> Response:
    state = request.app.state.server
    data = await state.read(request)
    classification = await state.offload(prepare_classification, state, data)
    return await classification.run(request)
