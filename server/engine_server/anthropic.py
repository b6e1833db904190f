"""Anthropic's Messages API: ``/v1/messages`` and ``/v1/messages/count_tokens``. A request is
translated into the chat-completions request it means (system and turns into chat messages,
``tool_use`` / ``tool_result`` blocks into tool calls and tool messages, tools and
``tool_choice`` into their OpenAI spellings) and goes down the chat route's path: the same
prompt building, sampling checks, tool and reasoning parsers, streaming and aborts. Only the
answer is rendered in Anthropic's shape (:mod:`engine_server.anthropic_output`), and errors
on these routes in Anthropic's error shape (:func:`engine_server.errors.anthropic_route`)."""

from __future__ import annotations

import json

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine_server import generation
from engine_server.anthropic_output import AnthropicGeneration
from engine_server.errors import bad_request
from engine_server.images import image_url_part
from engine_server.schemas import (
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
    ChatCompletionRequest,
)
from engine_server.tools import check_tools
from engine_server.validation import check_json_schema, decode_body

UNSUPPORTED_MEDIA = ("image", "document", "search_result")  # in system and tool results
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # Anthropic's


def _text(blocks, where: str, param: str) -> str:
    """The text of a string or of a list of text blocks (``system``, a tool result)."""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for i, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in UNSUPPORTED_MEDIA:
            raise _no_media(kind, f"{where}[{i}]", param)
        if kind != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"{where}[{i}] must be a text block {{'type': 'text', 'text': ...}}", param)
        parts.append(block["text"])
    return "\n".join(parts)


def _no_media(kind: str, where: str, param: str = "messages"):
    return bad_request(
        f"{where}: {kind} content blocks are not supported here: only a user turn's own blocks may be images",
        param,
    )


def _image_url(block: dict, where: str) -> str:
    """An image block's source as the URL the chat route reads: base64 data as a ``data:`` URL,
    a ``url`` source as it is (fetched only where the server's media flags allow)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if media_type not in IMAGE_MEDIA_TYPES or not isinstance(data, str):
            raise bad_request(
                f"{where}.source: a base64 image needs media_type (one of {', '.join(IMAGE_MEDIA_TYPES)}) "
                "and data (a base64 string)",
                "messages",
            )
        return f"data:{media_type};base64,{data}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise bad_request(
        f"{where}.source must be {{'type': 'base64', 'media_type': ..., 'data': ...}} or "
        f"{{'type': 'url', 'url': ...}}; got type {kind!r}",
        "messages",
    )


def _user_turn(index: int, content) -> list[dict]:
    """A user turn's chat messages: its tool results first (each a ``tool`` message, answering
    the assistant's calls before it), then its text and images (the chat route's ``image_url``
    parts, in order; a turn without images stays one string, as before)."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    results, parts = [], []
    for i, block in enumerate(content):
        where = f"messages[{index}].content[{i}]"
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(image_url_part(_image_url(block, where)))
        elif kind == "tool_result" and isinstance(block.get("tool_use_id"), str):
            result = _text(block.get("content") or "", f"{where}.content", "messages")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        elif kind in UNSUPPORTED_MEDIA:
            raise _no_media(kind, where)
        else:
            raise bad_request(
                f"{where}: a user turn's blocks are text ({{'type': 'text', 'text': ...}}), image or "
                f"tool_result ({{'type': 'tool_result', 'tool_use_id': ..., 'content': ...}}); got {kind!r}",
                "messages",
            )
    if not parts and results:
        return results
    if all(part["type"] == "text" for part in parts):
        return [*results, {"role": "user", "content": "\n".join(part["text"] for part in parts)}]
    return [*results, {"role": "user", "content": parts}]


def _is_call(block: dict) -> bool:
    return (
        isinstance(block.get("id"), str)
        and isinstance(block.get("name"), str)
        and isinstance(block.get("input"), dict)
    )


def _assistant_turn(index: int, content) -> dict:
    """An assistant turn as one chat message: its text, and its ``tool_use`` blocks as tool
    calls. Thinking blocks are left out: earlier reasoning is not read again, as on the chat
    route."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts, calls = [], []
    for i, block in enumerate(content):
        where = f"messages[{index}].content[{i}]"
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and _is_call(block):
            function = {"name": block["name"], "arguments": json.dumps(block["input"])}
            calls.append({"id": block["id"], "type": "function", "function": function})
        elif kind not in ("thinking", "redacted_thinking"):
            raise bad_request(
                f"{where}: an assistant turn's blocks are text, tool_use ({{'type': 'tool_use', 'id': ..., "
                f"'name': ..., 'input': {{...}}}}) or thinking; got {kind!r}",
                "messages",
            )
    return {"role": "assistant", "content": "\n".join(texts), **({"tool_calls": calls} if calls else {})}


def chat_messages(body: AnthropicCountTokensRequest) -> list[dict]:
    """The conversation as chat messages: the system prompt, then each turn."""
    if not body.messages:
        raise bad_request("messages: at least one message is required", "messages")
    if body.messages[0].role != "user":
        raise bad_request("messages: the first message must use the user role", "messages")
    system = _text(body.system, "system", "system") if body.system is not None else ""
    messages = [{"role": "system", "content": system}] if system else []
    for i, message in enumerate(body.messages):
        if message.role == "user":
            messages += _user_turn(i, message.content)
        else:
            messages.append(_assistant_turn(i, message.content))
    return messages


def _tool(index: int, tool: dict) -> dict:
    """A client tool (``name``, ``description``, ``input_schema``) as an OpenAI function tool."""
    where = f"tools[{index}]"
    if tool.get("type") not in (None, "custom"):
        raise bad_request(
            f"{where}: {tool['type']!r} tools are not supported; give client tools "
            "{'name': ..., 'description': ..., 'input_schema': {...}}",
            "tools",
        )
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise bad_request(f"{where}.name must be a non-empty string", "tools")
    schema = check_json_schema(tool.get("input_schema"), "tools", f"{where}.input_schema")
    if schema.get("type") != "object":
        raise bad_request(f"{where}.input_schema must be a schema of type 'object'", "tools")
    description = tool.get("description")
    described = {"description": description} if isinstance(description, str) else {}
    # in OpenAI's order: the tool parser writes the tools into the prompt as they are
    return {"type": "function", "function": {"name": tool["name"], **described, "parameters": schema}}


def _tool_choice(choice: dict | None) -> tuple[str | dict | None, bool]:
    """-> (OpenAI's tool_choice, parallel_tool_calls) for Anthropic's ``tool_choice``."""
    if choice is None:
        return None, True
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice: {'type': 'tool'} needs the tool's name", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    spelled = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if spelled is None:
        raise bad_request(f"tool_choice.type must be auto, any, tool or none; got {kind!r}", "tool_choice")
    return spelled, parallel


def _thinking(thinking: dict | None) -> dict | None:
    """``thinking`` as the chat template's ``enable_thinking`` (Qwen3-style templates read it);
    the reasoning comes back as thinking blocks when the server runs a --reasoning-parser."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise bad_request(f"thinking.type must be enabled, adaptive or disabled; got {kind!r}", "thinking")
    return {"enable_thinking": kind != "disabled"}


def chat_request(body: AnthropicCountTokensRequest, **sampling) -> ChatCompletionRequest:
    """The chat-completions request an Anthropic one means. A last assistant turn is a
    prefill: the model continues it, and the answer holds only what it adds."""
    tools = [_tool(i, tool) for i, tool in enumerate(body.tools or [])]
    tool_choice, parallel = _tool_choice(body.tool_choice)
    prefill = bool(body.messages) and body.messages[-1].role == "assistant"
    request = {
        "model": body.model,
        "messages": chat_messages(body),
        "add_generation_prompt": not prefill,
        "continue_final_message": prefill,
        "tools": tools or None,
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
        "chat_template_kwargs": _thinking(body.thinking),
        **sampling,
    }
    return msgspec.convert(request, ChatCompletionRequest)


def prepare_messages(state, data: bytes) -> AnthropicGeneration:
    body = decode_body(data, AnthropicMessagesRequest, state.allow_unknown_fields)
    lora = generation.check_model(state, body.model)  # a LoRA adapter's name selects it here too
    chat = chat_request(
        body,
        max_tokens=body.max_tokens,
        stop=body.stop_sequences,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stream=body.stream,
    )
    return generation.chat_generation(state, chat, AnthropicGeneration, lora)


def _count(state, data: bytes) -> dict:
    body = decode_body(data, AnthropicCountTokensRequest, state.allow_unknown_fields)
    generation.check_model(state, body.model)
    chat = chat_request(body)
    mode, _ = check_tools(chat.tools, chat.tool_choice)
    return {"input_tokens": len(generation.chat_prompt_ids(state, chat, mode)[0])}


async def messages(request: Request) -> Response:
    return await generation.generate(request, prepare_messages)


async def count_tokens(request: Request) -> Response:
    """The prompt's length in tokens, built as ``/v1/messages`` builds it."""
    state = request.app.state.server
    data = await state.read(request)
    return JSONResponse(await state.offload(_count, state, data))
