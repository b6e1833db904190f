"""models-llama against the core's model contract (logits and greedy tokens vs transformers,
also under preemption and prefix caching), on the engine's default backend and platform
(cpu-native when installed) and on the plain torch backend and cpu platform."""

import pytest

from engine.testing.models import ClassifierModelContract, ModelContract


class TestLlamaModels(ModelContract):
    model_class = "engine_models_llama.model:LlamaForCausalLM"
    long_prompt_lengths = (40, 57)  # longer than the Mistral config's 16-token window


@pytest.mark.slow  # the whole contract a second time, on the plain parts
class TestLlamaModelsOnTorchAttention(TestLlamaModels):
    attention_backend = "torch"
    platform = "cpu"


class TestLlamaClassifier(ClassifierModelContract):
    """Llama (two labels, softmax) and Qwen2 (one, sigmoid) ForSequenceClassification."""

    model_class = "engine_models_llama.model:LlamaForSequenceClassification"
