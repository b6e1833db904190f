"""The shapes of the server's JSON responses, for ``/openapi.json`` only (the routes build
plain dicts): declared so that a client generator, or schemathesis checking every answer,
knows what comes back. Fields a response carries only in some cases (``prompt_logprobs``,
``tool_calls`` ...) have defaults, so they are optional; every other one is required."""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None  # --enable-prompt-tokens-details


class PromptLogprob(msgspec.Struct, kw_only=True):
    logprob: float
    rank: int | None
    decoded_token: str


# vLLM's prompt_logprobs: per prompt position (the first null), token id -> its log-prob
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    # a prompt's log-probs, in its first sample's choice only (null in the others)
    prompt_logprobs: PromptLogprobs | None = None


class Timings(msgspec.Struct, kw_only=True):
    """``"timings": true`` (or --enable-request-timings): llama.cpp's object plus the queue
    time and the time to the first token, in milliseconds."""

    queue_ms: float
    ttft_ms: float
    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    kv_transfer_params: dict[str, Any] | None = None
    timings: Timings | None = None


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[TokenLogprob]


class ToolCallFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: str


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None  # --reasoning-parser
    tool_calls: list[ToolCall] | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # once per response, as vLLM's chat route
    kv_transfer_params: dict[str, Any] | None = None
    timings: Timings | None = None


class Embedding(msgspec.Struct, kw_only=True):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Embedding]
    usage: Usage


class Score(msgspec.Struct, kw_only=True):
    index: int
    object: Literal["score"]
    score: float


class ScoreResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Score]
    usage: Usage


class RerankedDocument(msgspec.Struct, kw_only=True):
    text: str


class RerankResult(msgspec.Struct, kw_only=True):
    index: int  # the document's position in the request
    relevance_score: float
    document: RerankedDocument | None = None  # with return_documents


class RerankUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    results: list[RerankResult]  # by relevance, highest first
    usage: RerankUsage


class Classification(msgspec.Struct, kw_only=True):
    index: int
    label: str  # the most probable label's name (the config's id2label)
    probs: list[float]
    num_classes: int


class ClassificationResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Classification]
    usage: Usage


class TokenizeResponse(msgspec.Struct, kw_only=True):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class Model(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str  # a LoRA adapter's: its folder
    parent: str | None = None  # a LoRA adapter's: the base model's id (vLLM's)
    max_model_len: int
    default_sampling_params: dict[str, Any]
    # the guarantee temperature-0 output has: "batch-invariant" (alone, batched, speculated,
    # cached or chunked), "chunk-invariant" (cached or chunked), "none"
    determinism: Literal["batch-invariant", "chunk-invariant", "none"]


class ModelList(msgspec.Struct, kw_only=True):
    object: Literal["list"]
    data: list[Model]


class Version(msgspec.Struct, kw_only=True):
    version: str


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorDetail


class AnthropicTextBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="text"):
    text: str


class AnthropicThinkingBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="thinking"):
    thinking: str  # the --reasoning-parser's reasoning
    signature: str


class AnthropicToolUseBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class AnthropicUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int


class AnthropicMessage(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[AnthropicTextBlock | AnthropicThinkingBlock | AnthropicToolUseBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicTokenCount(msgspec.Struct, kw_only=True):
    input_tokens: int


class AnthropicErrorDetail(msgspec.Struct, kw_only=True):
    type: str
    message: str


class AnthropicError(msgspec.Struct, kw_only=True):
    type: Literal["error"]
    error: AnthropicErrorDetail


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: dict[str, int]  # cached_tokens
    output_tokens: int
    output_tokens_details: dict[str, int]  # reasoning_tokens
    total_tokens: int


class ResponseObject(msgspec.Struct, kw_only=True):
    """``/v1/responses``: ``output`` holds ``message``, ``reasoning`` and ``function_call`` items."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    background: bool
    error: dict[str, Any] | None
    incomplete_details: dict[str, str] | None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    model: str
    output: list[dict[str, Any]]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any]
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["disabled"]
    usage: ResponseUsage | None
    user: str | None


class ResponseDeleted(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


class ResponseInputItems(msgspec.Struct, kw_only=True):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class IsSleeping(msgspec.Struct):
    is_sleeping: bool


class UpdateWeightsResult(msgspec.Struct):
    success: bool
    message: str


RESPONSES = [
    CompletionResponse,
    ChatCompletionResponse,
    EmbeddingResponse,
    ScoreResponse,
    RerankResponse,
    ClassificationResponse,
    TokenizeResponse,
    DetokenizeResponse,
    ModelList,
    Version,
    ErrorResponse,
    AnthropicMessage,
    AnthropicTokenCount,
    AnthropicError,
    ResponseObject,
    ResponseDeleted,
    ResponseInputItems,
    IsSleeping,
    UpdateWeightsResult,
]
