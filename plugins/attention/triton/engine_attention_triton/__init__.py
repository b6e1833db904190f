"""attention-triton: paged attention in Triton over the flattened ragged batch."""

from engine import hookimpl


@hookimpl
def register_attention_backends(register):
    register("triton", "engine_attention_triton.backend:TritonAttentionBackend", api=4)
