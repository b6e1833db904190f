"""FilesystemResolver: the adapter named NAME is the folder ``DIR/NAME``, where DIR is the
server's ``--lora-resolver-cache-dir`` (else ``$VLLM_LORA_RESOLVER_CACHE_DIR``), as vLLM's
filesystem resolver reads it; NAME may name a folder below DIR (``org/adapter``), as vLLM's.

The folder's real path (``..`` and symlinks resolved) must lie inside DIR, and an absolute
NAME is never looked up, so no request can make the server read outside the folder its
operator chose. The folder must hold a PEFT LoRA adapter (``adapter_config.json`` with
``peft_type`` LORA, and ``adapter_model.safetensors``); the engine checks the rest when it loads
it."""

from __future__ import annotations

import json
import os

from engine.interfaces import LoRAResolver

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class FilesystemResolver(LoRAResolver):
    def resolve(self, base_model_name: str, lora_name: str) -> str | None:
        if self.context.cache_dir is None or not lora_name or os.path.isabs(lora_name) or "\0" in lora_name:
            return None
        root = os.path.realpath(self.context.cache_dir)
        folder = os.path.realpath(os.path.join(root, lora_name))
        if folder == root or os.path.commonpath([root, folder]) != root or not is_lora_folder(folder):
            return None
        return folder


def is_lora_folder(folder: str) -> bool:
    """Whether ``folder`` holds a PEFT LoRA adapter's two files."""
    try:
        with open(os.path.join(folder, CONFIG_FILE)) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return (
        isinstance(config, dict)
        and config.get("peft_type", "LORA") == "LORA"
        and os.path.isfile(os.path.join(folder, WEIGHTS_FILE))
    )
