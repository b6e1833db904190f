"""models-gpt-oss: OpenAI's gpt-oss (attention sinks, sliding-window layers, MoE with MXFP4 experts)."""

from engine import hookimpl


@hookimpl
def register_models(register):
    register("GptOssForCausalLM", "engine_models_gpt_oss.model:GptOssForCausalLM", api=4)
