"""models-llama against the core's model contract (logits and greedy tokens vs transformers)."""

from engine.testing.models import ModelContract


class TestLlamaModels(ModelContract):
    model_class = "engine_models_llama.model:LlamaForCausalLM"
    long_prompt_lengths = (40, 57)  # longer than the Mistral config's 16-token window
