"""models-granite: IBM Granite 3.x dense decoders."""

from engine import hookimpl


@hookimpl
def register_models(register):
    register("GraniteForCausalLM", "engine_models_granite.model:GraniteForCausalLM", api=2)


@hookimpl
def register_tool_parsers(register):
    register("granite", "engine_models_granite.tool_parser:GraniteToolParser", api=3)
