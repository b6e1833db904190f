"""Planted bugs: the filesystem LoRA resolver with one mistake each, the mistakes resolver
authors make. Not registered by the suite's conftest: ``tests/test_lora_resolver_kit_mutations.py``
registers them in a child pytest that runs the LoRA resolver kit on each, and checks that it fails."""

from __future__ import annotations

import json
import os

from engine import hookimpl
from engine_loraresolvers_filesystem.resolver import FilesystemResolver, is_lora_folder


class JoinsBlindly(FilesystemResolver):
    """Answers ``DIR/NAME`` whether or not anything is there."""

    def resolve(self, base_model_name, lora_name):
        return os.path.join(self.context.cache_dir, lora_name)


class NoContainment(FilesystemResolver):
    """Checks the folder holds an adapter, but not that the name stays inside the folder."""

    def resolve(self, base_model_name, lora_name):
        folder = os.path.join(self.context.cache_dir, lora_name)
        return folder if lora_name and is_lora_folder(folder) else None


class RaisesOnUnknown(FilesystemResolver):
    """Reads the adapter's config without asking whether the name exists: an unknown name raises."""

    def resolve(self, base_model_name, lora_name):
        found = super().resolve(base_model_name, lora_name)
        with open(os.path.join(self.context.cache_dir, lora_name, "adapter_config.json")) as f:
            json.load(f)
        return found


class AnyFolder(FilesystemResolver):
    """Takes any folder of that name for an adapter."""

    def resolve(self, base_model_name, lora_name):
        if lora_name in ("", ".", "..") or os.sep in lora_name:
            return None
        folder = os.path.join(self.context.cache_dir, lora_name)
        return folder if os.path.isdir(folder) else None


class FirstAdapter(FilesystemResolver):
    """Answers the first adapter in the folder for every name it has."""

    def resolve(self, base_model_name, lora_name):
        if super().resolve(base_model_name, lora_name) is None:
            return None
        return os.path.join(self.context.cache_dir, min(os.listdir(self.context.cache_dir)))


MUTANTS = {
    "joins-blindly": JoinsBlindly,
    "no-containment": NoContainment,
    "raises-on-unknown": RaisesOnUnknown,
    "any-folder": AnyFolder,
    "first-adapter": FirstAdapter,
}


@hookimpl
def register_lora_resolvers(register):
    for name, resolver in MUTANTS.items():
        register(name, resolver, api=1)
