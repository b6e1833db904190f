"""models-llama: Llama-shaped decoders."""

from engine import hookimpl

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@hookimpl
def register_models(register):
    for arch in ARCHITECTURES:
        register(arch, "engine_models_llama.model:LlamaForCausalLM", api=2)
