"""models-llava: LLaVA-style vision-language models."""

from engine import hookimpl


@hookimpl
def register_models(register):
    register(
        "LlavaForConditionalGeneration", "engine_models_llava.model:LlavaForConditionalGeneration", api=2
    )
