"""models-llama against the core's model contract (logits and greedy tokens vs transformers,
also under preemption and prefix caching), on the engine's default backend and platform
(cpu-native when installed) and on the plain torch backend and cpu platform."""

import pytest

from engine.testing.models import ModelContract


class TestLlamaModels(ModelContract):
    model_class = "engine_models_llama.model:LlamaForCausalLM"


@pytest.mark.slow  # the whole contract a second time, on the plain parts
class TestLlamaModelsOnTorchAttention(ModelContract):
    model_class = "engine_models_llama.model:LlamaForCausalLM"
    attention_backend = "torch"
    platform = "cpu"
