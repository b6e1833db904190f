"""quant-gguf: GGUF files as a model format, and the embedded default model."""

from engine import hookimpl


@hookimpl
def register_model_loaders(register):
    register("gguf", "engine_quant_gguf.loader:GGUFLoader", api=1)
