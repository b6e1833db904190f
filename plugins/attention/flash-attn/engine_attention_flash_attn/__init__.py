"""attention-flash-attn: FlashAttention over the paged KV cache on CUDA."""

from engine import hookimpl


@hookimpl
def register_attention_backends(register):
    register("flash-attn", "engine_attention_flash_attn.backend:FlashAttnBackend", api=4)
