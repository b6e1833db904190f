"""quant-fp8: FP8 (e4m3) checkpoints in the Hugging Face ``fp8`` format, and online FP8."""

from engine import hookimpl


@hookimpl
def register_quant_methods(register):
    register("fp8", "engine_quant_fp8.method:Fp8LinearMethod", api=2)
