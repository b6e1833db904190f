"""The server's side of gpt-oss's harmony prompts: the core renders them
(:mod:`engine.entrypoints.harmony`, which ``LLM.chat`` uses too); here what cannot be rendered
becomes a 400 naming the field."""

from __future__ import annotations

from engine.entrypoints import harmony
from engine.messages.sampling_params import InvalidParam
from engine_server.errors import bad_request


def render_chat(messages: list[dict], tools: list[dict] | None, template_kwargs: dict | None) -> list[int]:
    """:func:`engine.entrypoints.harmony.render_chat`, its errors as 400s."""
    try:
        return harmony.render_chat(messages, tools, template_kwargs)
    except InvalidParam as exc:
        raise bad_request(str(exc), exc.param) from None
