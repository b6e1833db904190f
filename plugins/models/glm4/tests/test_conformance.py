"""models-glm4 against the core's model contract (log-probs and greedy tokens vs transformers,
mixed batches under chunked prefill and preemption, prefix caching): interleaved partial
rotary, the sandwich norms (drawn at random like every norm) and the fused gate|up checkpoint
tensor. Every run: the main example config on the cpu-native backend and platform; slow: the
tied, unbiased, quarter-rotary variant there, and both configs on the plain torch backend and
cpu platform."""

import pytest

from engine.testing.models import ModelContract


class TestGlm4ModelsOnCpuNative(ModelContract):
    """The main example config, every run."""

    model_class = "engine_models_glm4.model:Glm4ForCausalLM"
    attention_backend = "cpu-native"
    platform = "cpu-native"
    config_keys = ("Glm4ForCausalLM",)


@pytest.mark.slow  # the other example config
class TestGlm4VariantOnCpuNative(TestGlm4ModelsOnCpuNative):
    """The variant example config."""

    config_keys = ("Glm4ForCausalLM-tied-quarter-rotary",)


@pytest.mark.slow  # the whole contract a second time, on the plain parts
class TestGlm4ModelsOnTorchAttention(TestGlm4ModelsOnCpuNative):
    """Every example config on the torch backend and the plain cpu platform."""

    attention_backend = "torch"
    platform = "cpu"
    config_keys = None
