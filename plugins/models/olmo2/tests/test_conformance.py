"""models-olmo2 against the core's model contract (log-probs and greedy tokens vs transformers,
mixed batches under chunked prefill and preemption, prefix caching); the q/k norms' weights,
drawn at random like every norm's, differ from one per head. Every run: the main example
config on the cpu-native backend and platform; slow: the GQA, tied, biased variant there, and
both configs on the plain torch backend and cpu platform."""

import pytest

from engine.testing.models import ModelContract


class TestOlmo2ModelsOnCpuNative(ModelContract):
    """The main example config, every run."""

    model_class = "engine_models_olmo2.model:Olmo2ForCausalLM"
    attention_backend = "cpu-native"
    platform = "cpu-native"
    config_keys = ("Olmo2ForCausalLM",)


@pytest.mark.slow  # the other example config
class TestOlmo2VariantOnCpuNative(TestOlmo2ModelsOnCpuNative):
    """The variant example config."""

    config_keys = ("Olmo2ForCausalLM-gqa-tied-bias",)


@pytest.mark.slow  # the whole contract a second time, on the plain parts
class TestOlmo2ModelsOnTorchAttention(TestOlmo2ModelsOnCpuNative):
    """Every example config on the torch backend and the plain cpu platform."""

    attention_backend = "torch"
    platform = "cpu"
    config_keys = None
