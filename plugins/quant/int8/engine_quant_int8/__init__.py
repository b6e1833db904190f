"""quant-int8: online round-to-nearest int8 weights with per-output-channel scales."""

from engine import hookimpl


@hookimpl
def register_quant_methods(register):
    register("int8-w8a16", "engine_quant_int8.method:Int8WeightOnly", api=3)
    register("int8-w8a8", "engine_quant_int8.method:Int8Dynamic", api=3)
