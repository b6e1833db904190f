"""LoRAResolver: finds an adapter the server was not told about (vLLM's ``LoRAResolver``).

When a request names a model the server does not serve and runtime adapter loading is allowed
(``--allow-runtime-lora-updating`` or ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), the server
asks each installed resolver, in registry order, for the adapter: the first local folder one
returns is loaded (checked as ``/v1/load_lora_adapter`` checks it) and served under that name
from then on. A resolver only locates (and, for a remote store, fetches) the files; the server
assigns the adapter's id and loads it."""

from __future__ import annotations

from abc import ABC, abstractmethod

import attrs


@attrs.frozen
class LoRAResolverContext:
    """What a resolver is constructed with, once per server: the served base model's name and
    the adapter cache folder the operator gave (``--lora-resolver-cache-dir``, else
    ``$VLLM_LORA_RESOLVER_CACHE_DIR``; None when neither is set), for a resolver that reads a
    folder or downloads into one."""

    base_model_name: str
    cache_dir: str | None = None


class LoRAResolver(ABC):
    def __init__(self, context: LoRAResolverContext):
        self.context = context

    @abstractmethod
    def resolve(self, base_model_name: str, lora_name: str) -> str | None:
        """The local folder of the adapter called ``lora_name`` for ``base_model_name``, holding
        ``adapter_config.json`` (a LoRA: ``peft_type`` LORA) and ``adapter_model.safetensors`` as
        PEFT's ``save_pretrained`` writes them; None when this resolver does not have it.

        ``lora_name`` is whatever a client put in a request's ``model``: a name that would leave
        the resolver's store (``..``, a path separator, a symlink out of it) resolves to None,
        never to a folder outside it. An unknown name is None, not an exception. Called on a
        worker thread of the server, so it may block (read a disk, download)."""
