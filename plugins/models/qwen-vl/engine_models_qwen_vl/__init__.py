"""models-qwen-vl: Qwen2-VL and Qwen2.5-VL vision-language models."""

from engine import hookimpl

MODEL = "engine_models_qwen_vl.model:QwenVLForConditionalGeneration"


@hookimpl
def register_models(register):
    register("Qwen2_5_VLForConditionalGeneration", MODEL, api=5)
    register("Qwen2VLForConditionalGeneration", MODEL, api=5)
