"""models-qwen3 against the core's model contract for every example config (tied and untied
heads, GQA, head_dim other than hidden / heads): log-probs and greedy tokens vs transformers,
and, end to end, greedy tokens of mixed-length prompts under continuous batching with a KV
pool small enough to preempt, and with prefix caching. Pinned to the cpu-native backend and
platform (its fused q/k-norm kernel) and to the plain torch ones."""

import pytest

from engine.testing.models import ClassifierModelContract, ModelContract


class TestQwen3ModelsOnCpuNative(ModelContract):
    model_class = "engine_models_qwen3.model:Qwen3ForCausalLM"
    attention_backend = "cpu-native"
    platform = "cpu-native"


@pytest.mark.slow  # the whole contract a second time, on the plain parts
class TestQwen3ModelsOnTorchAttention(ModelContract):
    model_class = "engine_models_qwen3.model:Qwen3ForCausalLM"
    attention_backend = "torch"
    platform = "cpu"


class TestQwen3Classifier(ClassifierModelContract):
    """Hugging Face's Qwen3ForSequenceClassification: the last token's score head, one label
    (sigmoid) and three (softmax)."""

    model_class = "engine_models_qwen3.model:Qwen3ForSequenceClassification"
