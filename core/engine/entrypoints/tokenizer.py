"""Tokenizer access for front ends that run outside the engine-core process."""

from __future__ import annotations

from collections.abc import Sequence


def load_tokenizer(
    model: str | None = None, plugins: Sequence[str] | None = None, load_format: str | None = None
):
    """-> (resolved model path, tokenizer or None), through the same loader plugins the
    engine uses (``model=None``: the default model a plugin ships)."""
    from engine.core.setup import select_loader
    from engine.plugins import load_plugins

    loader, path = select_loader(load_plugins(plugins), model, load_format)
    return path, loader.tokenizer()
