"""Extension interfaces, one module per kind. Plugins import from here only."""

from engine.interfaces.attention import AttentionBackend, AttentionSpec, BatchLayout
from engine.interfaces.drafter import Draft, Drafter, DrafterContext, DraftRequest
from engine.interfaces.grammar import Grammar, GrammarBackend, GrammarContext, GrammarSpec
from engine.interfaces.kv_cache import KVCacheManager
from engine.interfaces.kv_connector import KVConnector
from engine.interfaces.loader import ModelLoader
from engine.interfaces.logits_processor import LogitsProcessor
from engine.interfaces.model import Model, StepContext
from engine.interfaces.platform import Platform
from engine.interfaces.quant import QuantMethod
from engine.interfaces.reasoning_parser import ReasoningParser
from engine.interfaces.scheduler import Scheduler
from engine.interfaces.tool_parser import ToolCall, ToolParser

# Interface version per kind. Bump a kind's number when its contract changes
# incompatibly; plugins declare the version they target with ``api=`` when registering.
INTERFACE_VERSIONS = {
    "platforms": 1,
    "attention_backends": 1,
    "models": 1,
    "model_loaders": 2,  # 2: iter_weights(keep_quantized=...)
    "quant_methods": 2,  # 2: dequantize (required), embed, describe, quantizes_embeddings
    "kv_connectors": 1,
    "grammar_backends": 1,
    "drafters": 1,
    "logits_processors": 1,
    "schedulers": 1,
    "kv_cache_managers": 1,
    "tool_parsers": 1,
    "reasoning_parsers": 1,
    "commands": 1,
}

__all__ = [
    "INTERFACE_VERSIONS", "AttentionBackend", "AttentionSpec", "BatchLayout", "Draft", "Drafter",
    "DrafterContext", "DraftRequest", "Grammar", "GrammarBackend", "GrammarContext", "GrammarSpec",
    "KVCacheManager", "KVConnector", "LogitsProcessor", "Model", "ModelLoader", "Platform", "QuantMethod",
    "ReasoningParser", "Scheduler", "StepContext", "ToolCall", "ToolParser",
]
