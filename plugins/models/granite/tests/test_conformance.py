"""models-granite against the core's model contract (log-probs and greedy tokens vs transformers,
mixed batches under chunked prefill and preemption, prefix caching), every multiplier away
from 1. Every run: the main example config on the cpu-native backend and platform; slow: the
untied, biased variant there, and both configs on the plain torch backend and cpu platform."""

import pytest

from engine.testing.models import ModelContract


class TestGraniteModelsOnCpuNative(ModelContract):
    """The main example config, every run."""

    model_class = "engine_models_granite.model:GraniteForCausalLM"
    attention_backend = "cpu-native"
    platform = "cpu-native"
    config_keys = ("GraniteForCausalLM",)


@pytest.mark.slow  # the other example config
class TestGraniteVariantOnCpuNative(TestGraniteModelsOnCpuNative):
    """The variant example config."""

    config_keys = ("GraniteForCausalLM-untied-bias",)


@pytest.mark.slow  # the whole contract a second time, on the plain parts
class TestGraniteModelsOnTorchAttention(TestGraniteModelsOnCpuNative):
    """Every example config on the torch backend and the plain cpu platform."""

    attention_backend = "torch"
    platform = "cpu"
    config_keys = None
