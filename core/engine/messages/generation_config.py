"""Default sampling parameters from a model's generation config, as vLLM's
``--generation-config``: ``auto`` (the default) takes them from the checkpoint (its
loader's :meth:`~engine.interfaces.ModelLoader.generation_config`), ``vllm`` uses none
(the built-in defaults), and a folder path reads the ``generation_config.json`` there.

Only the keys the file sets count (read from the JSON itself, not through
``transformers.GenerationConfig``, whose own defaults would otherwise leak in); a request
that sets a field keeps its own value. ``max_new_tokens`` becomes the ``max_tokens``
default."""

from __future__ import annotations

import json
import os

from engine.messages.sampling_params import InvalidParam, SamplingParams

FILE = "generation_config.json"
# generation-config key -> SamplingParams field
FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def read_generation_config(folder: str) -> dict | None:
    """The JSON of ``folder/generation_config.json``, or None when there is none."""
    path = os.path.join(folder, FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def default_sampling_params(mode: str, loader) -> dict:
    """SamplingParams fields (only those the config sets) for ``--generation-config MODE``.
    Raises ValueError naming ``generation_config`` for a missing folder or a bad value."""
    if mode == "vllm":
        return {}
    if mode == "auto":
        config = loader.generation_config()
    else:
        if not os.path.isdir(mode):
            raise ValueError(f"generation_config: {mode!r} is not auto, vllm or a folder")
        config = read_generation_config(mode)
        if config is None:
            raise ValueError(f"generation_config: no {FILE} in {mode!r}")
    defaults = {field: config[key] for key, field in FIELDS.items() if (config or {}).get(key) is not None}
    try:
        SamplingParams(**defaults)
    except (InvalidParam, TypeError) as exc:
        raise ValueError(f"generation_config: {exc}") from None
    return defaults
