"""models-glm4: GLM-4 (0414) dense decoders."""

from engine import hookimpl


@hookimpl
def register_models(register):
    register("Glm4ForCausalLM", "engine_models_glm4.model:Glm4ForCausalLM", api=2)
