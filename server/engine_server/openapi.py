"""``/openapi.json``: the request bodies with every bound the server enforces, including those
known only once the model is loaded (the vocabulary, the context, the fan-out cap), and the
response shapes (:mod:`engine_server.responses`), so that a schema-driven fuzzer such as
schemathesis can tell a wrong answer from a right one: a request that breaks the schema must
get a 4xx, and every response must match its declared shape."""

from __future__ import annotations

import msgspec

from engine_server.errors import anthropic_route
from engine_server.responses import RESPONSES
from engine_server.schemas import BODIES, MAX_N, OPTIONAL_BODIES

REF = "#/components/schemas/{name}"
ERROR = {
    "description": "OpenAI-shaped error",
    "content": {"application/json": {"schema": {"$ref": REF.format(name="ErrorResponse")}}},
}
ANTHROPIC_ERROR = {
    "description": "Anthropic-shaped error",
    "content": {"application/json": {"schema": {"$ref": REF.format(name="AnthropicError")}}},
}
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses")

# path: (method, request body, response body or media type, summary)
PATHS = {
    "/v1/completions": (
        "post",
        "CompletionRequest",
        "CompletionResponse",
        "Create a completion (stream with `stream: true`)",
    ),
    "/v1/chat/completions": (
        "post",
        "ChatCompletionRequest",
        "ChatCompletionResponse",
        "Create a chat completion",
    ),
    "/v1/messages": (
        "post",
        "AnthropicMessagesRequest",
        "AnthropicMessage",
        "Create a message (Anthropic's Messages API; stream with `stream: true`)",
    ),
    "/v1/messages/count_tokens": (
        "post",
        "AnthropicCountTokensRequest",
        "AnthropicTokenCount",
        "Tokens in an Anthropic Messages prompt",
    ),
    "/v1/embeddings": (
        "post",
        "EmbeddingRequest",
        "EmbeddingResponse",
        "Embeddings of the inputs (a server started with --runner pooling)",
    ),
    **dict.fromkeys(
        ("/score", "/v1/score"),
        (
            "post",
            "ScoreRequest",
            "ScoreResponse",
            "Scores of text pairs (a cross-encoder or an embedding model)",
        ),
    ),
    **dict.fromkeys(
        ("/rerank", "/v1/rerank", "/v2/rerank"),
        ("post", "RerankRequest", "RerankResponse", "Documents ranked by relevance to the query"),
    ),
    **dict.fromkeys(
        ("/classify", "/v1/classify"),
        ("post", "ClassificationRequest", "ClassificationResponse", "Label probabilities of the inputs"),
    ),
    "/v1/responses": (
        "post",
        "ResponsesRequest",
        "ResponseObject",
        "Create a response (OpenAI's Responses API; stream its events with `stream: true`)",
    ),
    "/tokenize": ("post", "TokenizeRequest", "TokenizeResponse", "Token ids of a prompt or chat"),
    "/detokenize": ("post", "DetokenizeRequest", "DetokenizeResponse", "Text of token ids"),
    "/v1/models": ("get", None, "ModelList", "The served model"),
    "/health": (
        "get",
        None,
        None,
        "200 while the engine core runs and makes progress, 503 (naming the reason) otherwise",
    ),
    "/version": ("get", None, "Version", "Server version"),
    "/metrics": ("get", None, "text/plain", "Prometheus metrics"),
}

RESET_PREFIX_CACHE = {
    "/reset_prefix_cache": ("post", None, None, "Forget every cached prompt block (409 while in use)"),
}
RUNTIME_LORA_PATHS = {
    "/v1/load_lora_adapter": ("post", "LoadLoRAAdapterRequest", "text/plain", "Load a LoRA adapter by name"),
    "/v1/unload_lora_adapter": ("post", "UnloadLoRAAdapterRequest", "text/plain", "Unload a LoRA adapter"),
}
SLEEP_PATHS = {
    "/sleep": (
        "post",
        None,
        None,
        (
            "Wait for the requests in flight, then give the KV cache (query level=1) and the weights "
            "(level=2) back; requests get 503 until /wake_up"
        ),
    ),
    "/wake_up": ("post", None, None, "Wake from /sleep"),
    "/is_sleeping": ("get", None, "IsSleeping", "Whether the engine sleeps"),
    "/update_weights_from_disk": (
        "post",
        "UpdateWeightsRequest",
        "UpdateWeightsResult",
        "Serve the weights of a checkpoint folder of the same architecture (after the requests in flight)",
    ),
    "/init_weights_update_group": (
        "post",
        "InitWeightsUpdateGroupRequest",
        "UpdateWeightsResult",
        "Join a trainer's torch.distributed group (gloo) to receive weights from it",
    ),
    "/update_weights_from_distributed": (
        "post",
        "UpdateWeightsFromDistributedRequest",
        "UpdateWeightsResult",
        "Receive the named tensors the trainer broadcasts and serve them (after the requests in flight)",
    ),
    "/destroy_weights_update_group": ("post", None, "UpdateWeightsResult", "Leave the trainer's group"),
}
LEVEL = {"name": "level", "in": "query", "required": False, "schema": {"type": "integer", "enum": [1, 2]}}

# routes of a stored response, by its id: path -> [(method, response body, summary)]
RESPONSE_ID_PATHS = {
    "/v1/responses/{response_id}": [
        ("get", "ResponseObject", "A stored response (404 once deleted or past --responses-store-ttl)"),
        ("delete", "ResponseDeleted", "Delete a stored response"),
    ],
    "/v1/responses/{response_id}/input_items": [
        ("get", "ResponseInputItems", "A stored response's input items (query: limit, order, after)"),
    ],
}
RESPONSE_ID = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}


def spec(state) -> dict:
    bodies = {**BODIES, **OPTIONAL_BODIES}
    _, components = msgspec.json.schema_components(list(bodies.values()) + RESPONSES, ref_template=REF)
    if not state.allow_unknown_fields:
        for name in bodies:
            components[name]["additionalProperties"] = False
    runtime_bounds(components, state)
    paths = {**PATHS, **RESET_PREFIX_CACHE}
    paths |= RUNTIME_LORA_PATHS if state.lora is not None and state.lora.runtime else {}
    paths |= SLEEP_PATHS if state.sleep_mode else {}
    described = {path: {method: operation(path, *rest)} for path, (method, *rest) in paths.items()}
    if "/sleep" in described:
        described["/sleep"]["post"]["parameters"] = [LEVEL]
    return {
        "openapi": "3.1.0",
        "info": {"title": "engine", "version": "0.1.0"},
        "paths": {
            **described,
            **{
                path: {
                    method: {**operation(path, None, answer, summary), "parameters": [RESPONSE_ID]}
                    for method, answer, summary in operations
                }
                for path, operations in RESPONSE_ID_PATHS.items()
            },
        },
        "components": {"schemas": components},
    }


def operation(path: str, body: str | None, answer: str | None, summary: str) -> dict:
    error = ANTHROPIC_ERROR if anthropic_route(path) else ERROR
    responses = {"200": _ok(path, answer), "4XX": error, "5XX": error}
    result = {"summary": summary, "responses": responses}
    if body:
        result["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": REF.format(name=body)}}},
        }
    return result


def _ok(path: str, answer: str | None) -> dict:
    if answer is None:
        return {"description": "OK (no body)"}
    if "/" in answer:
        return {"description": "OK", "content": {answer: {"schema": {"type": "string"}}}}
    content = {"application/json": {"schema": {"$ref": REF.format(name=answer)}}}
    if path in GENERATION_ROUTES:  # stream: true
        content["text/event-stream"] = {"schema": {"type": "string"}}
    return {"description": "OK", "content": content}


def runtime_bounds(components: dict, state) -> None:
    """The bounds that depend on the loaded model and the server's flags."""
    vocab_max = max(0, state.vocab_size - 1)
    context = state.max_model_len
    sequences = state.max_request_sequences
    _bound_integers(components["ResponsesRequest"]["properties"]["max_output_tokens"], max(1, context - 1))
    responses = components["ResponsesRequest"]
    # `input` is optional to msgspec only so that its absence is a 400 naming it
    responses["required"] = ["input"]
    responses["properties"]["input"] = {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "object"}, "minItems": 1},
        ]
    }
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = components[name]["properties"]
        for field in ("stop_token_ids", "allowed_token_ids"):
            _bound_integers(props[field], maximum=vocab_max)
        _bound_integers(props["n"], maximum=min(MAX_N, sequences))
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:  # the prompt takes at least one token of the context
                _bound_integers(props[field], maximum=max(1, context - 1))
        props["truncate_prompt_tokens"] = truncation_schema(context)
    pooling_bounds(components, vocab_max, context, sequences)
    components["CompletionRequest"]["properties"]["prompt"] = prompt_schema(vocab_max, context, sequences)
    _bound_integers(
        components["AnthropicMessagesRequest"]["properties"]["max_tokens"], maximum=max(1, context - 1)
    )
    for name in (
        "ChatCompletionRequest",
        "TokenizeRequest",
        "AnthropicMessagesRequest",
        "AnthropicCountTokensRequest",
    ):
        _min_items(components[name]["properties"]["messages"], 1)
    _bound_integers(components["DetokenizeRequest"]["properties"]["tokens"], maximum=vocab_max)


def pooling_bounds(components: dict, vocab_max: int, context: int, sequences: int) -> None:
    """The pooling routes' inputs as the server takes them: non-empty texts, at most
    ``--max-request-sequences`` inputs (a rerank's documents, a score's pairs), token ids of
    the vocabulary. An input's length is not bounded here: ``truncate_prompt_tokens`` may cut
    a longer one to fit the context."""
    for name in ("EmbeddingRequest", "ScoreRequest", "RerankRequest", "ClassificationRequest"):
        components[name]["properties"]["truncate_prompt_tokens"] = truncation_schema(context)
    for name in ("EmbeddingRequest", "ClassificationRequest"):
        components[name]["properties"]["input"] = prompt_schema(vocab_max, None, sequences)
    text = {"type": "string", "minLength": 1}
    texts = {"type": "array", "items": text, "minItems": 1, "maxItems": sequences}
    score = components["ScoreRequest"]["properties"]
    for field in ("text_1", "text_2", "queries", "documents", "data_1", "data_2"):
        score[field] = {"anyOf": [text, texts, {"type": "null"}], "default": None}
    rerank = components["RerankRequest"]["properties"]
    rerank["query"] = text
    rerank["documents"] = {**texts, "items": {"anyOf": [text, {"$ref": REF.format(name="RerankDocument")}]}}
    components["RerankDocument"]["properties"]["text"] = text


def truncation_schema(context: int) -> dict:
    """``truncate_prompt_tokens``: -1 (the context) or a count from 1 to the context (msgspec's
    bound, ge=-1, cannot leave out 0)."""
    count = {"type": "integer", "minimum": 1, "maximum": context}
    return {"anyOf": [{"const": -1}, count, {"type": "null"}], "default": None}


def prompt_schema(vocab_max: int, context: int | None, sequences: int) -> dict:
    """What ``prompt`` takes (msgspec's types cannot say it: ``list[Any]``): a text, texts, token
    ids, or lists of token ids; at most ``--max-request-sequences`` prompts, each at least one
    token and leaving room for one more in the ``context`` (None: not bounded, for an input
    that pools and may be truncated)."""
    ids = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": vocab_max},
        "minItems": 1,
        **({"maxItems": max(1, context - 1)} if context is not None else {}),
    }
    text = {"type": "string", "minLength": 1}
    return {
        "anyOf": [
            text,
            {"type": "array", "items": text, "minItems": 1, "maxItems": sequences},
            ids,
            {"type": "array", "items": ids, "minItems": 1, "maxItems": sequences},
        ]
    }


def _bound_integers(schema: dict, maximum: int) -> None:
    """Lower the ``maximum`` of every integer in ``schema`` (a field's, or its items')."""
    if schema.get("type") == "integer":
        schema["maximum"] = min(schema.get("maximum", maximum), maximum)
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key, ()):
            _bound_integers(option, maximum)
    if isinstance(schema.get("items"), dict):
        _bound_integers(schema["items"], maximum)


def _min_items(schema: dict, count: int) -> None:
    if schema.get("type") == "array":
        schema["minItems"] = max(schema.get("minItems", 0), count)
    for option in schema.get("anyOf", ()):
        _min_items(option, count)
