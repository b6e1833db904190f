"""gpt-oss's harmony chat format, rendered with the ``openai-harmony`` package: the system
message (reasoning effort, the valid channels), a developer message with the instructions and
the function tools as harmony's ``namespace functions``, and the conversation, earlier tool
calls (``commentary`` to ``functions.NAME``) and tool results included. The model answers on
channels (``analysis``, ``commentary``, ``final``) and stops at ``<|return|>`` or ``<|call|>``;
the server's ``engine_server.harmony_parsers`` read that back. One rendering for ``LLM.chat``
and the server (which turns :class:`InvalidParam` into a 400 naming the field): a chat format
beside the chat templates, as vLLM's, not a model's code, so it lives in the core.

The encoding needs the o200k vocabulary, which ``openai-harmony`` downloads unless
``TIKTOKEN_ENCODINGS_BASE`` names a folder holding ``o200k_base.tiktoken``. Where that is not
set, the file is written once from the copy ``quicktok-v1`` ships (checked against the
SHA-256 the encoding itself expects), so a server without internet access renders too."""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import struct
import tempfile
from importlib import resources

from engine.entrypoints.chat_template import conversation
from engine.messages.sampling_params import InvalidParam

O200K_FILE = "o200k_base.tiktoken"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
# harmony's level for each effort a client may ask (Responses' none ... xhigh)
EFFORTS = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"}
HARMONY_MODEL_TYPES = ("gpt_oss",)


def is_harmony_model(model_path: str) -> bool:
    """Whether the checkpoint at ``model_path`` speaks harmony (its config's model_type)."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            return json.load(f).get("model_type") in HARMONY_MODEL_TYPES
    except (OSError, ValueError, AttributeError):
        return False


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tessellm", "tiktoken")


def _o200k_from_quicktok() -> bytes | None:
    """o200k_base in tiktoken's file format (base64 token, rank per line), rebuilt from
    quicktok's packed copy (records of u16 length, bytes, u32 rank); None without quicktok."""
    try:
        packed = resources.files("quicktok").joinpath("data/o200k.vocab").read_bytes()
    except (ModuleNotFoundError, FileNotFoundError):
        return None
    (count,), at, ranked = struct.unpack_from("<I", packed), 4, []
    for _ in range(count):
        (length,) = struct.unpack_from("<H", packed, at)
        token = packed[at + 2 : at + 2 + length]
        (rank,) = struct.unpack_from("<I", packed, at + 2 + length)
        ranked.append((rank, token))
        at += 6 + length
    return b"".join(base64.b64encode(token) + b" %d\n" % rank for rank, token in sorted(ranked))


def offline_vocab_dir() -> str | None:
    """A folder holding the verified ``o200k_base.tiktoken``, written on first use; None when
    it cannot be had without the network."""
    folder = _cache_dir()
    path = os.path.join(folder, O200K_FILE)
    if os.path.exists(path):
        return folder
    data = _o200k_from_quicktok()
    if data is None or hashlib.sha256(data).hexdigest() != O200K_SHA256:
        return None
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, delete=False) as f:
        f.write(data)
    os.replace(f.name, path)
    return folder


@functools.cache
def encoding():
    """gpt-oss's harmony encoding (loaded once per process)."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    if not os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
        folder = offline_vocab_dir()
        if folder is not None:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = folder
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def stop_token_ids() -> list[int]:
    """``<|return|>`` and ``<|call|>``: the ends of an assistant's turn."""
    return list(encoding().stop_tokens_for_assistant_actions())


def _text(content) -> str:
    return content if isinstance(content, str) else ""


def _system(effort: str | None):
    from openai_harmony import Message, ReasoningEffort, Role, SystemContent

    if effort is not None and (not isinstance(effort, str) or effort not in EFFORTS):
        raise InvalidParam(
            "reasoning_effort", f"reasoning_effort must be one of {', '.join(EFFORTS)}; got {effort!r}"
        )
    level = ReasoningEffort(EFFORTS[effort or "medium"].capitalize())
    content = SystemContent.new().with_reasoning_effort(level)
    return Message.from_role_and_content(Role.SYSTEM, content)


def _developer(instructions: list[str], tools: list[dict] | None):
    from openai_harmony import DeveloperContent, Message, Role, ToolDescription

    content = DeveloperContent.new()
    if instructions:
        content = content.with_instructions("\n\n".join(instructions))
    if tools:
        content = content.with_function_tools(
            [
                ToolDescription.new(
                    f["name"], f.get("description") or "", parameters=f.get("parameters") or None
                )
                for f in (tool["function"] for tool in tools)
            ]
        )
    return Message.from_role_and_content(Role.DEVELOPER, content)


def _call(call) -> tuple[str, str]:
    """An earlier assistant tool call's (name, arguments as JSON text)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidParam(
            "messages", "each tool_calls entry must be {'function': {'name': ..., 'arguments': ...}}"
        )
    arguments = function.get("arguments", "")
    return function["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)


def _turns(messages: list[dict]) -> list:
    """The conversation after the instructions: user text, assistant answers (``final``) and
    tool calls (``commentary`` to ``functions.NAME``), tool results from ``functions.NAME``."""
    from openai_harmony import Author, Message, Role

    names: dict[str, str] = {}  # tool_call_id -> function name, for the results
    turns = []
    for message in messages:
        role, text = message["role"], _text(message["content"])
        if role == "user":
            turns.append(Message.from_role_and_content(Role.USER, text))
        elif role == "assistant":
            if message.get("reasoning_content"):
                turns.append(
                    Message.from_role_and_content(Role.ASSISTANT, message["reasoning_content"]).with_channel(
                        "analysis"
                    )
                )
            if text:
                turns.append(Message.from_role_and_content(Role.ASSISTANT, text).with_channel("final"))
            for call in message.get("tool_calls") or []:
                name, arguments = _call(call)
                names[call.get("id", "")] = name
                turns.append(
                    Message.from_role_and_content(Role.ASSISTANT, arguments)
                    .with_channel("commentary")
                    .with_recipient(f"functions.{name}")
                    .with_content_type("<|constrain|>json")
                )
        elif role == "tool":
            name = message.get("name") or names.get(message.get("tool_call_id", ""), "")
            turns.append(
                Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"), text)
                .with_channel("commentary")
                .with_recipient("assistant")
            )
    return turns


def render_chat(messages: list[dict], tools: list[dict] | None, template_kwargs: dict | None) -> list[int]:
    """Token ids of the conversation, ending where the assistant's turn begins. System and
    developer messages become the developer message's instructions; ``reasoning_effort``
    (``chat_template_kwargs``, as gpt-oss's own template reads it) sets the system's."""
    from openai_harmony import Conversation, Role

    if not messages:
        raise InvalidParam("messages", "messages must contain at least one message")
    plain = conversation(messages)
    effort = (template_kwargs or {}).get("reasoning_effort")
    instructions = [_text(m["content"]) for m in plain if m["role"] == "system" and _text(m["content"])]
    rendered = [_system(effort)]
    if instructions or tools:
        rendered.append(_developer(instructions, tools))
    rendered += _turns([m for m in plain if m["role"] != "system"])
    try:
        ids = encoding().render_conversation_for_completion(
            Conversation.from_messages(rendered), Role.ASSISTANT
        )
    except Exception as exc:  # noqa: BLE001 - what harmony cannot render is the caller's
        raise InvalidParam("messages", f"harmony could not render these messages: {exc}") from None
    return list(ids)
