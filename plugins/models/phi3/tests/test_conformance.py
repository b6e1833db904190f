"""models-phi3 against the core's model contract: log-probs and greedy tokens vs transformers,
mixed batches under chunked prefill and preemption, prefix caching; prompts longer than the
sliding-window config's 16-token window, so chunks cross its edge. On the cpu-native backend
and platform, and (slow) on the plain torch ones."""

import pytest

from engine.testing.models import ModelContract


class TestPhi3ModelsOnCpuNative(ModelContract):
    model_class = "engine_models_phi3.model:Phi3ForCausalLM"
    attention_backend = "cpu-native"
    platform = "cpu-native"
    long_prompt_lengths = (40, 23)


@pytest.mark.slow  # the whole contract a second time, on the plain parts
class TestPhi3ModelsOnTorchAttention(TestPhi3ModelsOnCpuNative):
    attention_backend = "torch"
    platform = "cpu"
