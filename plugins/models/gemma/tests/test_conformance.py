"""models-gemma against the core's model contract (logits and greedy tokens vs transformers),
with prompts longer than the sliding window and prefill chunks that cross its edge."""

from engine.testing.models import ModelContract


class TestGemmaModels(ModelContract):
    model_class = "engine_models_gemma.model:GemmaForCausalLM"
    long_prompt_lengths = (40, 57, 23)
