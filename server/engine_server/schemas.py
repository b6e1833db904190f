"""Request bodies of the OpenAI routes (field names as the OpenAI API, plus vLLM's extras) and
of the Anthropic ones (``/v1/messages``, as Anthropic's Messages API), decoded and type-checked
by msgspec (a wrong type or a value out of range becomes a 400 naming the field). Every integer
is bounded to what the engine and its wire format can hold (signed 64-bit), and the bounds are
part of the schema, so ``/openapi.json`` carries them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 128  # samples per prompt
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_ALLOWED_TOKEN_IDS = 2**20  # a whole vocabulary, for clients that send one
MAX_BAD_WORDS = 256

Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Meta(ge=1, le=INT64_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=INT64_MAX)]  # the vocabulary bound is checked once the model is known
Logprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]  # OpenAI's range (vLLM clamps instead)
# vLLM's truncate_prompt_tokens: -1 (the context) or a count of tokens to keep (0 is a 400 too)
Truncation = Annotated[int, Meta(ge=-1, le=INT64_MAX)]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    max_tokens: Count | None = None
    temperature: Annotated[float, Meta(ge=0.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=INT64_MAX)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    seed: Int64 | None = None
    stop: StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions
    ignore_eos: bool = False
    min_tokens: Annotated[int, Meta(ge=0, le=INT64_MAX)] = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Int64 = 0
    cache_salt: Annotated[str, Meta(min_length=1, max_length=1024)] | None = None  # vLLM's bounds
    prompt_logprobs: Logprobs | None = None  # log-probs of every prompt token (top-n alternatives)
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Meta(min_length=1)] | None = None
    guided_grammar: str | None = None
    logit_bias: Annotated[dict[str, Bias], Meta(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = (
        None  # "token id": bias
    )
    allowed_token_ids: (
        Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None
    ) = None
    bad_words: Annotated[list[StopString], Meta(max_length=MAX_BAD_WORDS)] | None = None
    truncate_prompt_tokens: Truncation | None = None  # keep the last k; -1: context
    return_tokens_as_token_ids: bool | None = None  # logprob tokens as "token_id:N"; None: the server's flag
    timings: bool | None = None  # llama.cpp's timings object in the response; None: the server's flag
    kv_transfer_params: dict[str, Any] | None = (
        None  # P/D disaggregation (vLLM's field): see engine.kv_transfer
    )


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[Any]
    logprobs: Logprobs | None = None
    echo: bool = False


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = (
        None  # an assistant turn's reasoning (vLLM's field), for templates that show it
    )


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    store: bool = False  # OpenAI's stored completions: only false (what OpenAI SDK users send) is served


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    # with messages, templated as /v1/chat/completions would
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: str | list[Any]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Count | None = None  # matryoshka models only
    user: str | None = None
    # vLLM extensions
    normalize: bool | None = None  # None: the server's --pooler-config
    priority: Int64 = 0
    truncate_prompt_tokens: Truncation | None = None  # keep the first k; -1: context


Texts = str | list[str]


class ScoreRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``/score``: the pairs as ``text_1``/``text_2``, ``queries``/``documents`` or
    ``data_1``/``data_2`` (one of the three spellings): one first text against every second, or
    both lists zipped."""

    model: str | None = None
    text_1: Texts | None = None
    text_2: Texts | None = None
    queries: Texts | None = None
    documents: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None
    user: str | None = None
    priority: Int64 = 0
    truncate_prompt_tokens: Truncation | None = None  # each input's first k tokens; -1: context


class RerankDocument(msgspec.Struct, kw_only=True):
    text: str


class RerankRequest(msgspec.Struct, kw_only=True):
    """``/rerank`` (Jina's and Cohere's shape, as vLLM serves it): ``top_n`` 0 returns every document."""

    query: str
    documents: list[str | RerankDocument]
    model: str | None = None
    top_n: Annotated[int, Meta(ge=0, le=INT64_MAX)] = 0
    return_documents: bool = True
    user: str | None = None
    priority: Int64 = 0
    truncate_prompt_tokens: Truncation | None = None  # each input's first k tokens; -1: context


class ClassificationRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``/classify``: ``input`` as ``/v1/embeddings`` takes it (texts or token ids)."""

    input: str | list[Any]
    model: str | None = None
    user: str | None = None
    priority: Int64 = 0
    truncate_prompt_tokens: Truncation | None = None  # keep the first k; -1: context


class AnthropicInputMessage(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant"]
    # a string, or content blocks (text, tool_use, tool_result ...: checked as they are translated)
    content: str | list[dict[str, Any]]


class AnthropicCountTokensRequest(msgspec.Struct, kw_only=True):
    """What makes an Anthropic prompt: ``/v1/messages/count_tokens`` takes these fields,
    ``/v1/messages`` these and the sampling ones."""

    model: str
    messages: list[AnthropicInputMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # {"type": "enabled" | "adaptive" | "disabled", ...}


class AnthropicMessagesRequest(AnthropicCountTokensRequest, kw_only=True):
    max_tokens: Count  # required, as Anthropic requires it
    stop_sequences: Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None  # Anthropic's range
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0, le=INT64_MAX)] | None = None
    metadata: dict[str, Any] | None = None  # {"user_id": ...}: accepted, as OpenAI's `user`


MetadataKey = Annotated[str, Meta(max_length=64)]
MetadataValue = Annotated[str, Meta(max_length=512)]


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """OpenAI's Responses API (``/v1/responses``); ``input`` items, ``tools``, ``tool_choice``
    and ``text`` are checked field by field where they are translated (responses_api.py),
    so the errors name the item. ``truncation`` "auto" and ``background`` are refused."""

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None  # required: a 400 naming it when missing
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: Count | None = None
    temperature: Annotated[float, Meta(ge=0.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    store: bool = True
    metadata: Annotated[dict[MetadataKey, MetadataValue], Meta(max_length=16)] | None = None
    stream: bool = False
    background: bool = False
    truncation: Literal["disabled"] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: Annotated[int, Meta(ge=-1, le=INT64_MAX)] | None = None
    seed: Int64 | None = None
    priority: Int64 = 0
    cache_salt: Annotated[str, Meta(min_length=1, max_length=1024)] | None = None


BODIES = {
    "CompletionRequest": CompletionRequest,
    "ChatCompletionRequest": ChatCompletionRequest,
    "TokenizeRequest": TokenizeRequest,
    "DetokenizeRequest": DetokenizeRequest,
    "EmbeddingRequest": EmbeddingRequest,
    "ScoreRequest": ScoreRequest,
    "RerankRequest": RerankRequest,
    "ClassificationRequest": ClassificationRequest,
    "AnthropicMessagesRequest": AnthropicMessagesRequest,
    "AnthropicCountTokensRequest": AnthropicCountTokensRequest,
    "ResponsesRequest": ResponsesRequest,
}


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/load_lora_adapter`` (vLLM's)."""

    lora_name: str = ""
    lora_path: str = ""


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/unload_lora_adapter`` (vLLM's)."""

    lora_name: str = ""


class UpdateWeightsRequest(msgspec.Struct, kw_only=True):
    """``POST /update_weights_from_disk`` (SGLang's): the checkpoint folder to serve from now on."""

    model_path: str = ""


class InitWeightsUpdateGroupRequest(msgspec.Struct, kw_only=True):
    """``POST /init_weights_update_group`` (SGLang's): join a trainer's ``torch.distributed`` group,
    whose TCP store the trainer (rank 0) hosts at ``master_address:master_port``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "gloo"


class UpdateWeightsFromDistributedRequest(msgspec.Struct, kw_only=True):
    """``POST /update_weights_from_distributed`` (SGLang's): the tensors the trainer broadcasts
    next, in order, by checkpoint name — ``names``/``dtypes``/``shapes``, or one ``name``/``dtype``/
    ``shape`` as SGLang's first version took them. ``group_name`` and ``flush_cache`` are taken
    for SGLang's clients and change nothing: one group is open at a time, and the prefix cache is
    always forgotten (its blocks were computed with the old weights)."""

    names: list[str] = []
    dtypes: list[str] = []
    shapes: list[list[int]] = []
    name: str | None = None
    dtype: str | None = None
    shape: list[int] | None = None
    group_name: str = "weight_update_group"
    flush_cache: bool = True


# the routes a server has only with a flag (--allow-runtime-lora-updating, --enable-sleep-mode)
OPTIONAL_BODIES = {
    "LoadLoRAAdapterRequest": LoadLoRAAdapterRequest,
    "UnloadLoRAAdapterRequest": UnloadLoRAAdapterRequest,
    "UpdateWeightsRequest": UpdateWeightsRequest,
    "InitWeightsUpdateGroupRequest": InitWeightsUpdateGroupRequest,
    "UpdateWeightsFromDistributedRequest": UpdateWeightsFromDistributedRequest,
}
