"""models-transformers against the core's model contract: GPT-2, GPT-NeoX, Falcon and OPT (no
model plugin claims them, so ``model_impl="auto"`` picks the fallback) run through transformers'
own modelling code on the paged KV cache — log-probs and greedy tokens equal transformers', also
under chunked prefill, preemption and prefix caching."""

from engine.testing.models import ModelContract


class TestTransformersFallback(ModelContract):
    model_class = "engine_models_transformers.model:TransformersForCausalLM"
