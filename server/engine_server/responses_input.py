"""A ``/v1/responses`` request as the chat request it means: its input items (and those of the
stored conversation it continues) as chat messages, ``instructions`` as the system message,
function tools, ``tool_choice`` and ``text.format`` in their chat spellings. Everything is
checked here, so a 400 names the Responses field (``input[2].call_id``, ``text.format``);
from there the chat route's own code (templates, tool grammars, structured outputs) runs."""

from __future__ import annotations

from engine_server.errors import bad_request
from engine_server.images import image_url_part
from engine_server.responses_output import new_id
from engine_server.schemas import ChatCompletionRequest, ChatMessage, ResponsesRequest
from engine_server.validation import check_json_schema

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
IMAGE_PART = "input_image"
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
SUMMARIES = ("auto", "concise", "detailed")


def input_items(given: str | list[dict]) -> list[dict]:
    """The request's input as checked items, each with an id (``GET .../input_items`` lists
    them): a string is one user message."""
    if not given:
        raise bad_request("input must be a non-empty string or a non-empty list of items", "input")
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": given}]
    return [_item(i, item) for i, item in enumerate(given)]


def _item(i: int, item: dict) -> dict:
    kind = item.get("type", "message" if "role" in item else None)
    where = f"input[{i}]"
    if kind == "message":
        return _message(where, item)
    if kind == "function_call":
        fields = {key: _string(item, key, where) for key in ("call_id", "name", "arguments")}
        return {"type": kind, "id": item.get("id") or new_id("fc"), **fields, "status": "completed"}
    if kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _text_parts(f"{where}.output", output, ("input_text",))
        call_id = _string(item, "call_id", where)
        return {"type": kind, "id": item.get("id") or new_id("fco"), "call_id": call_id, "output": text}
    if kind == "reasoning":  # an earlier turn's output given back: kept, not templated
        return {**item, "id": item.get("id") or new_id("rs")}
    raise bad_request(
        f"{where}.type must be message, function_call, function_call_output or reasoning; got {kind!r}",
        "input",
    )


def _message(where: str, item: dict) -> dict:
    role = item.get("role")
    if role not in ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}", "input")
    content = item.get("content")
    part_type = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        parts = [{"type": part_type, "text": content}]
    elif role == "user" and isinstance(content, list):
        parts = [_user_part(f"{where}.content[{j}]", part) for j, part in enumerate(content)]
    else:
        _text_parts(f"{where}.content", content, TEXT_PARTS)
        parts = [{"type": p["type"], "text": p["text"]} for p in content]
    return {"type": "message", "id": item.get("id") or new_id("msg"), "role": role, "content": parts}


def _user_part(where: str, part) -> dict:
    """A user message's part: text, or an ``input_image`` by URL (a ``data:`` URL, or one the
    server's media flags let it read; a ``file_id`` names nothing this server stores)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS and isinstance(part.get("text"), str):
        return {"type": kind, "text": part["text"]}
    if kind == IMAGE_PART and isinstance(part.get("image_url"), str):
        return {"type": kind, "image_url": part["image_url"], "detail": part.get("detail") or "auto"}
    if kind == IMAGE_PART:
        raise bad_request(
            f"{where}.image_url must be a URL string (data:image/...;base64,... or https://...); "
            "file_id images are not supported",
            "input",
        )
    raise bad_request(
        f"{where} must be an input_text part with a text or an input_image part with an image_url; "
        f"got type {kind!r}",
        "input",
    )


def _chat_content(parts: list[dict]) -> str | list[dict]:
    """A message's parts as chat content: their text joined, or (with images) the chat route's
    text and ``image_url`` parts in order."""
    if all(part["type"] != IMAGE_PART for part in parts):
        return "".join(part["text"] for part in parts)
    return [
        image_url_part(part["image_url"])
        if part["type"] == IMAGE_PART
        else {"type": "text", "text": part["text"]}
        for part in parts
    ]


def _text_parts(where: str, parts, kinds: tuple[str, ...]) -> str:
    """The text of a list of text parts; anything else (an image, a file) is a 400."""
    if not isinstance(parts, list):
        raise bad_request(f"{where} must be a string or a list of {' / '.join(kinds)} parts", "input")
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise bad_request(
                f"{where}[{j}] must be a {' or '.join(kinds)} part with a text (this server takes "
                f"text only); got type {kind!r}",
                "input",
            )
    return "".join(part["text"] for part in parts)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string", "input")
    return value


def chat_messages(instructions: str | None, items: list[dict]) -> list[ChatMessage]:
    """The conversation as the chat route takes it. A function call joins the assistant
    message before it (one chat turn with text and calls), or starts one; its output is a
    ``tool`` message; a reasoning item is the next assistant message's ``reasoning_content``
    (templates that show it: gpt-oss's harmony keeps the reasoning behind a pending call)."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    reasoning = None
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            reasoning = _reasoning_text(item)
            continue
        if kind == "message":
            messages.append({"role": item["role"], "content": _chat_content(item["content"])})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if messages and messages[-1]["role"] == "assistant" and not reasoning:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        if reasoning and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = reasoning
        reasoning = None
    return [ChatMessage(**message) for message in messages]


def _reasoning_text(item: dict) -> str | None:
    """A reasoning item's text: its ``reasoning_text`` content, else its summary."""
    parts = [p for p in item.get("content") or [] if isinstance(p, dict)] or [
        p for p in item.get("summary") or [] if isinstance(p, dict)
    ]
    return "".join(p["text"] for p in parts if isinstance(p.get("text"), str)) or None


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Function tools (``{type, name, description, parameters, strict}``) as chat tools."""
    if tools is None:
        return None
    translated = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(
                f"tools[{i}].type must be function (this server runs no hosted tools); "
                f"got {tool.get('type')!r}",
                "tools",
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools[{i}].name must be a non-empty string", "tools")
        if tool.get("parameters") is not None:
            check_json_schema(tool["parameters"], "tools", f"tools[{i}].parameters")
        keys = ("name", "description", "parameters", "strict")
        translated.append(
            {"type": "function", "function": {k: tool[k] for k in keys if tool.get(k) is not None}}
        )
    return translated


def chat_tool_choice(choice):
    """``{"type": "function", "name": ...}`` in the chat spelling; the strings are the same."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise bad_request(
            "tool_choice must be none, auto, required or {'type': 'function', 'name': ...}", "tool_choice"
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def chat_response_format(text: dict | None) -> dict | None:
    """``text.format`` as the chat route's ``response_format``."""
    if not text:
        return None
    unknown = sorted(set(text) - {"format"})
    if unknown:
        raise bad_request(f"text.{unknown[0]} is not supported (only text.format is)", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        schema = check_json_schema(fmt.get("schema"), "text", "text.format.schema")
        if not isinstance(fmt.get("name"), str):
            raise bad_request("text.format.name must be a string", "text")
        return {
            "type": "json_schema",
            "json_schema": {"name": fmt["name"], "schema": schema, "strict": fmt.get("strict")},
        }
    if kind in ("json_object", "text"):
        return {"type": kind}
    raise bad_request(f"text.format.type must be text, json_object or json_schema; got {kind!r}", "text")


def template_kwargs(reasoning: dict | None) -> dict | None:
    """``reasoning.effort`` reaches the chat template as ``reasoning_effort`` (what templates
    that read one, gpt-oss's, call it); ``summary`` is accepted and the reasoning itself
    returned, as there are no summaries to make."""
    if not reasoning:
        return None
    for key, allowed in (("effort", EFFORTS), ("summary", SUMMARIES), ("generate_summary", SUMMARIES)):
        if reasoning.get(key) not in (None, *allowed):
            raise bad_request(f"reasoning.{key} must be one of {', '.join(allowed)}", "reasoning")
    unknown = sorted(set(reasoning) - {"effort", "summary", "generate_summary"})
    if unknown:
        raise bad_request(f"reasoning.{unknown[0]} is not supported", "reasoning")
    return {"reasoning_effort": reasoning["effort"]} if reasoning.get("effort") else None


def chat_request(body: ResponsesRequest, items: list[dict]) -> ChatCompletionRequest:
    """The chat request that generates this response's output from the conversation ``items``."""
    return ChatCompletionRequest(
        model=body.model,
        messages=chat_messages(body.instructions, items),
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        priority=body.priority,
        cache_salt=body.cache_salt,
        user=body.user,
        stream=body.stream,
        tools=chat_tools(body.tools),
        tool_choice=chat_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=chat_response_format(body.text),
        chat_template_kwargs=template_kwargs(body.reasoning),
    )
