"""models-qwen3 against the core's model contract: log-probs and greedy tokens vs transformers
for every example config (tied and untied heads, GQA, head_dim other than hidden / heads)."""

from engine.testing.models import ModelContract


class TestQwen3Models(ModelContract):
    model_class = "engine_models_qwen3.model:Qwen3ForCausalLM"
