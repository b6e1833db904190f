"""Tokenizer and image processor access for front ends that run outside the engine-core process."""

from __future__ import annotations

from collections.abc import Sequence


def resolve_model(
    model: str | None, plugins: Sequence[str] | None = None, load_format: str | None = None
) -> str:
    """The checkpoint path the engine will load for ``model`` (None: the default model a plugin
    ships), without loading anything: a front end passes it on to the engine core it starts."""
    from engine.core.setup import select_loader
    from engine.plugins import load_plugins

    return select_loader(load_plugins(plugins), model, load_format)[1]


def load_tokenizer(
    model: str | None = None, plugins: Sequence[str] | None = None, load_format: str | None = None
):
    """-> (resolved model path, tokenizer or None), through the same loader plugins the
    engine uses (``model=None``: the default model a plugin ships)."""
    from engine.core.setup import select_loader
    from engine.plugins import load_plugins

    loader, path = select_loader(load_plugins(plugins), model, load_format)
    return path, loader.tokenizer()


def load_multimodal_processor(
    model: str,
    plugins: Sequence[str] | None = None,
    load_format: str | None = None,
    model_impl: str = "auto",
    limit_mm_per_prompt: dict | None = None,
    mm_processor_kwargs: dict | None = None,
):
    """-> (the model's :class:`engine.interfaces.MultiModalProcessor` or None, why the engine
    takes no images or None): the front end of another process expands a prompt's images
    with the same processor class the engine core builds (the same model class chosen)."""
    from engine.core.setup import choose_model_class, select_loader
    from engine.messages.multimodal import build_processor, no_images_reason
    from engine.plugins import load_plugins

    registry = load_plugins(plugins)
    loader, path = select_loader(registry, model, load_format)
    hf_config = loader.hf_config()
    model_class, _ = choose_model_class(registry, hf_config, model_impl)
    reason = no_images_reason(model_class, limit_mm_per_prompt)
    if reason is not None:
        return None, reason
    return build_processor(model_class.multimodal_processor, path, hf_config, mm_processor_kwargs), None
