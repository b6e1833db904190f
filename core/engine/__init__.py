"""engine: a plugin-microkernel LLM inference engine.

``from engine import LLM, SamplingParams`` for offline use; ``engine.hookimpl`` to write a
plugin; :data:`PUBLIC_MODULES` for a front end. Heavy modules load on first use, so plugin
discovery stays cheap.
"""

from engine import openmp

openmp.apply()  # before anything imports torch: libgomp reads its variables as it loads

from engine.hookspecs import hookimpl

_LAZY = {
    "LLM": "engine.entrypoints.llm",
    "SamplingParams": "engine.messages.sampling_params",
    "PoolingParams": "engine.messages.pooling_params",
    "EmbeddingRequestOutput": "engine.messages.outputs",
    "EmbeddingOutput": "engine.messages.outputs",
    "ClassificationRequestOutput": "engine.messages.outputs",
    "ScoringRequestOutput": "engine.messages.outputs",
    "RequestOutput": "engine.messages.outputs",
    "CompletionOutput": "engine.messages.outputs",
    "Logprob": "engine.messages.outputs",
    "EngineConfig": "engine.config",
    "GrammarSpec": "engine.messages.sampling_params",
    "INTERFACE_VERSIONS": "engine.interfaces",
    "load_tokenizer": "engine.entrypoints.tokenizer",
    "LoRARequest": "engine.messages.lora",
}

__all__ = [
    "INTERFACE_VERSIONS",
    "LLM",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineConfig",
    "GrammarSpec",
    "LoRARequest",
    "Logprob",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "ScoringRequestOutput",
    "hookimpl",
    "load_tokenizer",
]  # the names _LAZY serves, plus hookimpl

# A front end's public API: ``__all__`` above and these modules (each with its ``__all__`` where
# it has one). The server imports nothing else of the engine (tests/test_public_api.py); the rest
# may change without notice. A plugin's public API: docs/plugin-authors.md, "The public API".
PUBLIC_MODULES = (
    "engine.client",  # the engine clients and the output processor, one for every front end
    "engine.client.kv_events",  # KV events over ZMQ in vLLM's wire format, for routers
    "engine.client.protocol",  # the messages between a front end and the engine-core process
    "engine.entrypoints.chat_template",  # chat messages' roles and content, the template's options
    "engine.entrypoints.cli",  # the ``engine`` command's Command and engine flags, for a plugin's subcommand
    "engine.entrypoints.harmony",  # gpt-oss's harmony format: conversations rendered, its stop tokens
    "engine.entrypoints.images",  # images in chat messages: data URLs read and bounded
    "engine.entrypoints.tokenizer",
    "engine.interfaces",  # the plugin interfaces
    "engine.kv_transfer",  # P/D disaggregation: ``kv_transfer_params`` and the connector kit
    "engine.lora",  # LoRARequest: the adapter a request runs with
    "engine.messages.multimodal",  # a request's images: their items, placeholders widened, limits checked
    "engine.messages.kv_events",  # KV events, and the prefix cache's block hashes as a router computes them
    "engine.messages.outputs",  # the offline API's results
    "engine.messages.pooling_params",
    "engine.messages.scoring",  # the score task's pairs and scores (/score, /rerank)
    "engine.messages.request_path",  # a prompt's checks and a request's samples, the same in every front end
    "engine.messages.sampling_params",
    "engine.messages.stats",  # the engine's statistics as one message
    "engine.plugins",  # loading plugins, the registry
)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
