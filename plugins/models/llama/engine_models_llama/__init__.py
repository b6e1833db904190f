"""models-llama: Llama-shaped decoders, and the same as sequence classifiers."""

from engine import hookimpl

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
CLASSIFIERS = ("LlamaForSequenceClassification", "Qwen2ForSequenceClassification")


@hookimpl
def register_models(register):
    for arch in ARCHITECTURES:
        register(arch, "engine_models_llama.model:LlamaForCausalLM", api=2)
    for arch in CLASSIFIERS:
        register(arch, "engine_models_llama.model:LlamaForSequenceClassification", api=5)
