"""models-granite against the core's model contract (log-probs and greedy tokens vs transformers,
mixed batches under chunked prefill and preemption, prefix caching) for both example configs,
every multiplier away from 1. On the cpu-native backend and platform, and (slow) on the plain
torch ones."""

import pytest

from engine.testing.models import ModelContract


class TestGraniteModelsOnCpuNative(ModelContract):
    model_class = "engine_models_granite.model:GraniteForCausalLM"
    attention_backend = "cpu-native"
    platform = "cpu-native"


@pytest.mark.slow  # the whole contract a second time, on the plain parts
class TestGraniteModelsOnTorchAttention(TestGraniteModelsOnCpuNative):
    attention_backend = "torch"
    platform = "cpu"
