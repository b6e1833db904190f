"""What a request may pass to a chat template, for every front end (``LLM.chat`` and the
server): the messages' roles and content (:func:`conversation`); ``chat_template_kwargs``
become template variables (e.g. ``enable_thinking``) but none may steer the templating call
itself, and ``continue_final_message`` excludes ``add_generation_prompt``, as in vLLM."""

from __future__ import annotations

from engine.messages.sampling_params import InvalidParam

ROLES = ("system", "developer", "user", "assistant", "tool")  # "developer": OpenAI's newer "system"

# apply_chat_template arguments that steer the call itself, not the template
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def template_options(
    add_generation_prompt: bool, continue_final_message: bool, chat_template_kwargs=None
) -> dict:
    """Keyword arguments for ``transformers``' ``apply_chat_template``; InvalidParam naming
    the field for a combination vLLM refuses or a reserved variable name.
    ``continue_final_message`` leaves the last message open (no end-of-turn after it)."""
    if continue_final_message and add_generation_prompt:
        raise InvalidParam(
            "continue_final_message",
            "cannot set both continue_final_message and "
            "add_generation_prompt to true (set add_generation_prompt to false to continue the "
            "last message)",
        )
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise InvalidParam("chat_template_kwargs", "chat_template_kwargs must be a dict")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(chat_template_kwargs or {}))
    if reserved:
        raise InvalidParam(
            "chat_template_kwargs",
            f"chat_template_kwargs may not set {', '.join(reserved)} "
            "(a request field or the templating call itself)",
        )
    return {
        **(chat_template_kwargs or {}),
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
    }


def conversation(messages, image_parts: bool = False) -> list[dict]:
    """The messages as a template reads them, or InvalidParam naming the first bad one: each a
    dict with a role of :data:`ROLES` (``developer`` becomes ``system``) and content that is a
    string, None (empty) or a list of text parts (joined), or of text and ``{"type": "image"}``
    parts when ``image_parts`` (kept as a list: :func:`engine.entrypoints.images.split_images`
    made them, and the caller hands the images on); its other fields that are set pass."""
    return [_message(i, message, image_parts) for i, message in enumerate(messages)]


def _is_text(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def _message(index: int, message, image_parts: bool) -> dict:
    role = message.get("role") if isinstance(message, dict) else None
    if role not in ROLES:
        raise InvalidParam(
            "messages", f"messages[{index}].role must be one of {', '.join(ROLES)}; got {role!r}"
        )
    content = message.get("content")
    if isinstance(content, list):
        for part in content:
            if not (_is_text(part) or (image_parts and part == {"type": "image"})):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                supported = "text, image_url, image_pil" if image_parts else "only text parts here"
                raise InvalidParam(
                    "messages", f"messages[{index}].content: unsupported content part {kind!r} ({supported})"
                )
        if all(_is_text(part) for part in content):  # a template that reads strings only
            content = "".join(part["text"] for part in content)
    entry = {key: value for key, value in message.items() if value is not None}
    return {**entry, "role": "system" if role == "developer" else role, "content": content or ""}
