"""models-phi3: Phi-3 and Phi-4 dense decoders."""

from engine import hookimpl


@hookimpl
def register_models(register):
    register("Phi3ForCausalLM", "engine_models_phi3.model:Phi3ForCausalLM", api=2)
