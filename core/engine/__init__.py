"""engine: a plugin-microkernel LLM inference engine.

``from engine import LLM, SamplingParams`` for offline use; ``engine.hookimpl`` to write a
plugin. Heavy modules load on first use, so plugin discovery stays cheap.
"""

from engine.hookspecs import hookimpl

_LAZY = {
    "LLM": "engine.llm",
    "SamplingParams": "engine.sampling_params",
    "PoolingParams": "engine.pooling_params",
    "EmbeddingRequestOutput": "engine.outputs",
    "EmbeddingOutput": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "Logprob": "engine.outputs",
    "EngineConfig": "engine.config",
    "GrammarSpec": "engine.sampling_params",
    "INTERFACE_VERSIONS": "engine.interfaces",
    "load_tokenizer": "engine.tokenizer",
}

__all__ = ["INTERFACE_VERSIONS", "LLM", "CompletionOutput", "EmbeddingOutput", "EmbeddingRequestOutput",
           "EngineConfig", "GrammarSpec", "Logprob", "PoolingParams", "RequestOutput", "SamplingParams", "hookimpl",
           "load_tokenizer"]  # the names _LAZY serves, plus hookimpl


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
