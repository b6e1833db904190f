"""quant-bitsandbytes: checkpoints saved by transformers with a ``BitsAndBytesConfig``
(``quant_method: bitsandbytes``), 4-bit and 8-bit."""

from engine import hookimpl


@hookimpl
def register_quant_methods(register):
    register("bitsandbytes", "engine_quant_bitsandbytes.method:BitsAndBytesLinearMethod", api=5)
