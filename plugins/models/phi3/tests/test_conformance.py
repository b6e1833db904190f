"""models-phi3 against the core's model contract: log-probs and greedy tokens vs transformers,
mixed batches under chunked prefill and preemption, prefix caching. Every run: the main example
config (LongRoPE, partial rotary, a 32-token window that the 40-token prompts outgrow) on the
cpu-native backend and platform; slow: the plain variant there, and both configs on the plain
torch backend and cpu platform."""

import pytest

from engine.testing.models import ModelContract


class TestPhi3ModelsOnCpuNative(ModelContract):
    """The main example config, every run."""

    model_class = "engine_models_phi3.model:Phi3ForCausalLM"
    attention_backend = "cpu-native"
    platform = "cpu-native"
    long_prompt_lengths = (40, 23)  # longer than the main config's window
    config_keys = ("Phi3ForCausalLM",)


@pytest.mark.slow  # the other example config
class TestPhi3VariantOnCpuNative(TestPhi3ModelsOnCpuNative):
    """The variant example config."""

    config_keys = ("Phi3ForCausalLM-plain",)


@pytest.mark.slow  # the whole contract a second time, on the plain parts
class TestPhi3ModelsOnTorchAttention(TestPhi3ModelsOnCpuNative):
    """Every example config on the torch backend and the plain cpu platform."""

    attention_backend = "torch"
    platform = "cpu"
    config_keys = None
