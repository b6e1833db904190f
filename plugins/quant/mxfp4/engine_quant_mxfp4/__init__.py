"""quant-mxfp4: OCP MX FP4 (e2m1 values in blocks of 32 with an E8M0 shared scale)."""

from engine import hookimpl


@hookimpl
def register_quant_methods(register):
    register("mxfp4", "engine_quant_mxfp4.method:Mxfp4LinearMethod", api=2)
