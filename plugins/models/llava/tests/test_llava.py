"""models-llava against the core's multimodal model contract: ``transformers``'
LlavaForConditionalGeneration on a tiny random checkpoint (CLIP tower, Llama text model)."""

from engine.testing.multimodal import MultiModalContract
from engine_models_llava.testing import save_tiny_llava


class TestLlava(MultiModalContract):
    model_class = "engine_models_llava.model:LlavaForConditionalGeneration"
    plugins = ("models-llava", "attention-torch")

    @classmethod
    def save_checkpoint(cls, folder: str):
        return save_tiny_llava(folder)
