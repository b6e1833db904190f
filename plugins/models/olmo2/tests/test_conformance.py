"""models-olmo2 against the core's model contract (log-probs and greedy tokens vs transformers,
mixed batches under chunked prefill and preemption, prefix caching) for both example configs;
the q/k norms' weights, drawn at random like every norm's, differ from one per head. On the
cpu-native backend and platform, and (slow) on the plain torch ones."""

import pytest

from engine.testing.models import ModelContract


class TestOlmo2ModelsOnCpuNative(ModelContract):
    model_class = "engine_models_olmo2.model:Olmo2ForCausalLM"
    attention_backend = "cpu-native"
    platform = "cpu-native"


@pytest.mark.slow  # the whole contract a second time, on the plain parts
class TestOlmo2ModelsOnTorchAttention(TestOlmo2ModelsOnCpuNative):
    attention_backend = "torch"
    platform = "cpu"
