"""Prompts of a request as token ids: completion prompts in their four shapes, a chat
conversation through the model's template, and the checks against the context length,
the vocabulary and the per-request cap on engine requests. Called off the event loop."""

from __future__ import annotations

import msgspec

from engine.entrypoints.chat_template import conversation, template_options
from engine.messages import request_path
from engine.messages.multimodal import MultiModalItem
from engine.messages.pooling_params import pooling_token_ids
from engine.messages.sampling_params import InvalidParam
from engine_server.errors import bad_request
from engine_server.images import ImageInput, take_images, takes_images, with_images


def check_fanout(state, prompts: int, n: int, param: str = "prompt") -> None:
    """Prompts × samples is the number of engine requests one HTTP request creates."""
    limit = state.max_request_sequences
    if prompts > limit:
        raise bad_request(f"a request may carry at most {limit} prompts, got {prompts}", param)
    if prompts * n > limit:
        raise bad_request(
            f"{prompts} prompt(s) with n={n} make {prompts * n} sequences; the limit per request is {limit}",
            "n",
        )


def check_prompt(
    state, ids: list[int], max_tokens: int | None, param: str, generates: bool = True, image_tokens: int = 0
) -> None:
    """The core's prompt check (:func:`engine.messages.request_path.check_prompt`) as a 400;
    ``image_tokens``: how many of ``ids`` are image placeholders (said when the prompt is too long)."""
    try:
        request_path.check_prompt(ids, state.vocab_size, state.max_model_len, max_tokens, param, generates)
    except InvalidParam as exc:
        images = f" ({image_tokens} of its tokens are image placeholders)" if image_tokens else ""
        raise bad_request(f"{exc}{images}", exc.param) from None


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def completion_prompts(
    state, prompt, n: int, param: str = "prompt", keep: int | None = None
) -> list[tuple[str | None, list[int]]]:
    """-> (text or None, token ids) per prompt (``param`` names the field: ``input`` on
    /v1/embeddings); the fan-out cap is checked before any prompt is tokenized. ``keep``: a
    pooling route's ``truncate_prompt_tokens``, each prompt cut to its first ``keep`` tokens
    (:func:`engine.messages.pooling_params.pooling_token_ids`)."""
    if isinstance(prompt, str):
        texts = [prompt]
    elif prompt and _is_ids(prompt):
        check_fanout(state, 1, n, param)
        return [(None, list(prompt)[:keep])]
    elif prompt and all(isinstance(p, str) for p in prompt):
        texts = prompt
    elif prompt and all(_is_ids(p) for p in prompt):
        check_fanout(state, len(prompt), n, param)
        return [(None, list(p)[:keep]) for p in prompt]
    else:
        raise bad_request(
            f"{param} must be a string, a list of strings, a list of token ids or a list of such lists", param
        )
    check_fanout(state, len(texts), n, param)
    if not all(texts):  # whether a tokenizer would make a token of it (a BOS) is no business of the client
        raise bad_request(f"{param} must not be empty", param)
    if keep is not None:
        return [(text, pooling_token_ids(state.tokenizer, text, keep=keep)) for text in texts]
    return [(text, state.tokenizer.encode(text)) for text in texts]


def chat_prompt(
    tokenizer,
    messages,
    add_generation_prompt: bool,
    tools: list[dict] | None = None,
    tool_prompt: str | None = None,
    continue_final_message: bool = False,
    template_kwargs: dict | None = None,
    images: ImageInput | None = None,
) -> tuple[list[int], tuple[MultiModalItem, ...]]:
    """Token ids of the templated conversation, and its images' items. Tools go to the
    template when it renders them; otherwise ``tool_prompt`` (the tool parser's instructions)
    joins the system message. ``continue_final_message`` leaves the last message open (no
    end-of-turn after it), so the model continues it, as ``transformers``'
    ``apply_chat_template`` does. ``images``: how a multimodal model's image parts are read
    (None: no image parts, as on routes that take none)."""
    if not messages:
        raise bad_request("messages must contain at least one message", "messages")
    plain, decoded = take_images(images, [msgspec.structs.asdict(message) for message in messages])
    try:
        options = template_options(add_generation_prompt, continue_final_message, template_kwargs)
        messages = conversation(plain, image_parts=takes_images(images))
    except InvalidParam as exc:
        raise bad_request(str(exc), exc.param) from None
    if not tokenizer.chat_template:
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    template_tools = None
    if tools:
        if "tools" in tokenizer.chat_template:
            template_tools = tools
        elif tool_prompt:
            if messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + tool_prompt}
            else:
                messages.insert(0, {"role": "system", "content": tool_prompt})
    try:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, tools=template_tools, **options)
    except Exception as exc:  # noqa: BLE001 - template errors (roles out of order ...) are the caller's
        raise bad_request(f"the chat template rejected these messages: {exc}", "messages") from None
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return with_images(images, ids, decoded) if takes_images(images) else (ids, ())
