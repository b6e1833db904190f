"""attention-mla-torch: multi-head latent attention over paged latent caches in plain PyTorch."""

from engine import hookimpl


@hookimpl
def register_attention_backends(register):
    register("mla-torch", "engine_attention_mla_torch.backend:MLATorchBackend", api=5)
