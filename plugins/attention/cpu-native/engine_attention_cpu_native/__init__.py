"""attention-cpu-native: paged attention in C for the CPU, reading KV blocks in place."""

from engine import hookimpl


@hookimpl
def register_attention_backends(register):
    register("cpu-native", "engine_attention_cpu_native.backend:NativeAttentionBackend", api=6)
