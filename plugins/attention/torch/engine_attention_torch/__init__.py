"""attention-torch: reference paged attention in plain PyTorch."""

from engine import hookimpl


@hookimpl
def register_attention_backends(register):
    register("torch", "engine_attention_torch.backend:TorchAttentionBackend", api=6)
