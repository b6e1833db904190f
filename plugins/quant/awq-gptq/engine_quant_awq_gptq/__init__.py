"""quant-awq-gptq: AWQ and GPTQ checkpoints, repacked at load into the engine's group-affine
kernels."""

from engine import hookimpl


@hookimpl
def register_quant_methods(register):
    register("awq", "engine_quant_awq_gptq.method:AwqLinearMethod", api=5)
    register("gptq", "engine_quant_awq_gptq.method:GptqLinearMethod", api=5)
