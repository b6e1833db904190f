"""loraresolvers-filesystem: LoRA adapters found by name in a local folder."""

from engine import hookimpl


@hookimpl
def register_lora_resolvers(register):
    register("filesystem", "engine_loraresolvers_filesystem.resolver:FilesystemResolver", api=1)
