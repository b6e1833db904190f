"""models-gpt-oss against the core's model contract: a gpt-oss-20b-shaped tiny random checkpoint
(sinks, alternating sliding-window layers, YaRN, clamped-SwiGLU experts with biases), greedy
tokens and log-probs against transformers, mixed batches with chunked prefill and preemption,
prefix caching. Sinks, router and expert biases are drawn at random (transformers zeroes the
biases); the kit's prompts (up to 41 tokens, 24-token chunks) outgrow the 8-token window."""

from engine.testing.models import ModelContract


class TestGptOss(ModelContract):
    """On the reference attention backend; the MXFP4 test runs under the engine's own choice
    (cpu-native's C kernel, which honours sinks, where it builds)."""

    model_class = "engine_models_gpt_oss.model:GptOssForCausalLM"
    attention_backend = "torch"
    random_parameters = ("sinks", "router.bias", "gate_up_proj_bias", "down_proj_bias")
