"""attention-sdpa: paged attention through torch's scaled_dot_product_attention.

The module the entry point names holds only the hook: the backend's module (and torch's
attention kernels) are imported when the engine selects ``sdpa``, not at plugin discovery.
"""

from engine import hookimpl


@hookimpl
def register_attention_backends(register):
    register("sdpa", "engine_attention_sdpa.backend:SdpaAttentionBackend", api=6)
