"""The LoRA resolver contract: what the server relies on when it asks a resolver for an adapter
it does not know (:class:`engine.interfaces.LoRAResolver`).

Subclass it in the plugin's tests and name the registration::

    from engine.testing.lora_resolver import LoRAResolverContract

    class TestMyResolver(LoRAResolverContract):
        resolver_name = "my-store"

The kit writes small PEFT-shaped adapters and puts them where the resolver looks with
:meth:`LoRAResolverContract.publish`: by default a folder ``store/NAME`` (a folder-backed
resolver, whose ``cache_dir`` is ``store``); a resolver over another store (a bucket, a
registry) overrides :meth:`~LoRAResolverContract.context` and
:meth:`~LoRAResolverContract.publish` to stage them there."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.interfaces import LoRAResolver, LoRAResolverContext
from engine.plugins import load_plugins, loaded_versions

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def write_adapter(folder: Path, seed: int, peft_type: str = "LORA") -> Path:
    """A small adapter as PEFT's ``save_pretrained`` lays it out: rank 4 on layer 0's q_proj."""
    folder.mkdir(parents=True)
    config = {"peft_type": peft_type, "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file(
        {
            f"{prefix}.lora_A.weight": torch.randn(4, 16, generator=gen),
            f"{prefix}.lora_B.weight": torch.randn(16, 4, generator=gen),
        },
        str(folder / WEIGHTS_FILE),
    )
    return folder


def same_files(resolved: str | None, adapter: Path) -> bool:
    """Whether ``resolved`` is a folder holding exactly ``adapter``'s config and weights."""
    if resolved is None:
        return False
    folder = Path(resolved)
    return all(
        (folder / name).is_file() and (folder / name).read_bytes() == (adapter / name).read_bytes()
        for name in (CONFIG_FILE, WEIGHTS_FILE)
    )


class LoRAResolverContract:
    resolver_name: str  # the registered name under test
    base_model_name = "tiny-base"

    def context(self, store: Path) -> LoRAResolverContext:
        """How the server would construct the resolver over ``store``."""
        return LoRAResolverContext(self.base_model_name, str(store))

    def publish(self, store: Path, name: str, adapter: Path) -> None:
        """Make the adapter folder ``adapter`` findable as ``name``."""
        shutil.copytree(adapter, store / name)

    @pytest.fixture
    def store(self, tmp_path) -> Path:
        store = tmp_path / "store"
        store.mkdir()
        return store

    @pytest.fixture
    def adapters(self, tmp_path) -> dict[str, Path]:
        """Adapter folders outside the store, to publish: ``one``, ``two``."""
        return {
            name: write_adapter(tmp_path / "made" / name, seed) for seed, name in enumerate(["one", "two"])
        }

    def resolver(self, store: Path) -> LoRAResolver:
        cls = load_plugins().get("lora_resolvers", self.resolver_name)
        return cls(self.context(store))

    def test_registered_for_an_interface_version_this_core_loads(self):
        registration = load_plugins().registration("lora_resolvers", self.resolver_name)
        assert registration.api in loaded_versions("lora_resolvers")
        assert issubclass(registration.load(), LoRAResolver)

    def test_a_published_adapter_resolves_to_its_files(self, store, adapters):
        self.publish(store, "one", adapters["one"])
        resolved = self.resolver(store).resolve(self.base_model_name, "one")
        assert same_files(resolved, adapters["one"]), resolved

    def test_each_name_resolves_to_its_own_adapter(self, store, adapters):
        for name, folder in adapters.items():
            self.publish(store, name, folder)
        resolver = self.resolver(store)
        for name, folder in adapters.items():
            assert same_files(resolver.resolve(self.base_model_name, name), folder), name

    def test_an_unknown_name_is_none(self, store, adapters):
        self.publish(store, "one", adapters["one"])
        assert self.resolver(store).resolve(self.base_model_name, "three") is None

    def test_resolving_again_gives_the_same_adapter(self, store, adapters):
        self.publish(store, "one", adapters["one"])
        resolver = self.resolver(store)
        first = resolver.resolve(self.base_model_name, "one")
        assert same_files(first, adapters["one"])
        assert same_files(resolver.resolve(self.base_model_name, "one"), adapters["one"])

    def test_names_that_leave_the_store_are_none(self, store, adapters, tmp_path):
        """A request's ``model`` is the client's: it must not reach an adapter beside the store."""
        self.publish(store, "one", adapters["one"])
        outside = str(adapters["two"])  # an adapter outside the store, by relative and absolute paths
        resolver = self.resolver(store)
        for name in ["../made/two", "one/../../made/two", outside, "..", ".", ""]:
            assert resolver.resolve(self.base_model_name, name) is None, name

    def test_an_entry_that_is_no_lora_adapter_is_none(self, store, tmp_path):
        notes = tmp_path / "made" / "notes"
        notes.mkdir(parents=True)
        (notes / "README.md").write_text("not an adapter")
        self.publish(store, "notes", notes)
        self.publish(
            store, "prompt", write_adapter(tmp_path / "made" / "prompt", 3, peft_type="PROMPT_TUNING")
        )
        resolver = self.resolver(store)
        assert resolver.resolve(self.base_model_name, "notes") is None
        assert resolver.resolve(self.base_model_name, "prompt") is None
