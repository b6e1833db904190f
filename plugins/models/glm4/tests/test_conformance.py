"""models-glm4 against the core's model contract (log-probs and greedy tokens vs transformers,
mixed batches under chunked prefill and preemption, prefix caching) for both example configs:
interleaved partial rotary, the sandwich norms (drawn at random like every norm) and the fused
gate|up checkpoint tensor. On the cpu-native backend and platform, and (slow) on the plain
torch ones."""

import pytest

from engine.testing.models import ModelContract


class TestGlm4ModelsOnCpuNative(ModelContract):
    model_class = "engine_models_glm4.model:Glm4ForCausalLM"
    attention_backend = "cpu-native"
    platform = "cpu-native"


@pytest.mark.slow  # the whole contract a second time, on the plain parts
class TestGlm4ModelsOnTorchAttention(TestGlm4ModelsOnCpuNative):
    attention_backend = "torch"
    platform = "cpu"
