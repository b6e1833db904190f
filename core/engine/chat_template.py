"""What a request may pass to a chat template, for every front end (``LLM.chat`` and the
server): ``chat_template_kwargs`` become template variables (e.g. ``enable_thinking``) but
none may steer the templating call itself, and ``continue_final_message`` excludes
``add_generation_prompt``, as in vLLM."""

from __future__ import annotations

from engine.sampling_params import InvalidParam

# apply_chat_template arguments that steer the call itself, not the template
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs"})


def template_options(add_generation_prompt: bool, continue_final_message: bool, chat_template_kwargs=None) -> dict:
    """Keyword arguments for ``transformers``' ``apply_chat_template``; InvalidParam naming
    the field for a combination vLLM refuses or a reserved variable name.
    ``continue_final_message`` leaves the last message open (no end-of-turn after it)."""
    if continue_final_message and add_generation_prompt:
        raise InvalidParam("continue_final_message", "cannot set both continue_final_message and "
                           "add_generation_prompt to true (set add_generation_prompt to false to continue the "
                           "last message)")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise InvalidParam("chat_template_kwargs", "chat_template_kwargs must be a dict")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(chat_template_kwargs or {}))
    if reserved:
        raise InvalidParam("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(reserved)} "
                           "(a request field or the templating call itself)")
    return {**(chat_template_kwargs or {}), "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message}
