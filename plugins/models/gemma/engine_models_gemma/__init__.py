"""models-gemma: Gemma 2 and Gemma 3 (text-only) decoders."""

from engine import hookimpl

ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


@hookimpl
def register_models(register):
    for arch in ARCHITECTURES:
        register(arch, "engine_models_gemma.model:GemmaForCausalLM", api=2)
