"""attention-flashinfer: FlashInfer's paged attention wrappers on CUDA."""

from engine import hookimpl


@hookimpl
def register_attention_backends(register):
    register("flashinfer", "engine_attention_flashinfer.backend:FlashInferBackend", api=4)
