"""quant-compressed-tensors: checkpoints written by the ``compressed-tensors`` library
(``quantization_config.quant_method: "compressed-tensors"``), run on the engine's quant kernels."""

from engine import hookimpl


@hookimpl
def register_quant_methods(register):
    register(
        "compressed-tensors", "engine_quant_compressed_tensors.method:CompressedTensorsLinearMethod", api=5
    )
