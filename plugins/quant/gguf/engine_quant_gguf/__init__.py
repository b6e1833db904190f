"""quant-gguf: GGUF files as a model format, their weights kept quantized, and the embedded
default model."""

from engine import hookimpl


@hookimpl
def register_model_loaders(register):
    register("gguf", "engine_quant_gguf.loader:GGUFLoader", api=3)


@hookimpl
def register_quant_methods(register):
    register("gguf", "engine_quant_gguf.method:GGUFLinearMethod", api=3)
