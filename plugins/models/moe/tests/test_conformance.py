"""models-moe against the core's model contract (logits and greedy tokens vs transformers)."""

from engine.testing.models import ModelContract


class TestMoeModels(ModelContract):
    model_class = "engine_models_moe.model:MoeForCausalLM"
