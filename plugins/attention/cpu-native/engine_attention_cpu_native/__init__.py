"""attention-cpu-native: paged attention in C for the CPU, reading KV blocks in place, and
multi-head latent attention's decode in C over the paged latent cache (``mla-cpu-native``)."""

from engine import hookimpl


@hookimpl
def register_attention_backends(register):
    register("cpu-native", "engine_attention_cpu_native.backend:NativeAttentionBackend", api=6)
    register("mla-cpu-native", "engine_attention_cpu_native.mla:MLANativeBackend", api=6)
