"""models-transformers: the fallback model, transformers' own modelling code on the paged KV cache."""

from engine import hookimpl
from engine.interfaces import FALLBACK_ARCHITECTURE


@hookimpl
def register_models(register):
    register(FALLBACK_ARCHITECTURE, "engine_models_transformers.model:TransformersForCausalLM", api=2)
