"""``--dry-run``: what an engine for these options would choose and hold, without loading it."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.core import startup
from engine.plugins import load_plugins


def startup_plan(engine_options: dict) -> str:
    """The start-up report (:mod:`engine.core.startup`) planned without loading weights or
    allocating the KV cache: parts, memory by use, the KV cache's tokens."""
    config = EngineConfig.from_kwargs(**engine_options)
    return startup.plan(config, load_plugins(config.plugins)).render("engine start-up plan (dry run)")
