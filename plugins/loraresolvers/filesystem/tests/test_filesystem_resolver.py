"""The filesystem resolver runs the LoRA resolver kit, and what is its own: names of folders
below the folder (vLLM's ``org/adapter``), symlinks inside the folder followed and out of it not,
and without a folder nothing resolves."""

import os

from engine.interfaces import LoRAResolverContext
from engine.testing.lora_resolver import LoRAResolverContract, same_files, write_adapter
from engine_loraresolvers_filesystem.resolver import FilesystemResolver


class TestFilesystemResolver(LoRAResolverContract):
    resolver_name = "filesystem"


def test_a_symlink_inside_the_folder_is_followed_and_one_out_of_it_is_not(tmp_path):
    store = tmp_path / "store"
    inside = write_adapter(store / "real", 1)
    outside = write_adapter(tmp_path / "outside", 2)
    os.symlink(inside, store / "alias")
    os.symlink(outside, store / "escape")
    resolver = FilesystemResolver(LoRAResolverContext("base", str(store)))
    assert same_files(resolver.resolve("base", "alias"), inside)
    assert resolver.resolve("base", "escape") is None


def test_a_name_may_name_a_folder_below(tmp_path):
    nested = write_adapter(tmp_path / "org" / "sql", 1)
    resolver = FilesystemResolver(LoRAResolverContext("base", str(tmp_path)))
    assert same_files(resolver.resolve("base", "org/sql"), nested)
    assert resolver.resolve("base", "org") is None  # a folder of adapters is not one


def test_without_a_folder_nothing_resolves(tmp_path):
    write_adapter(tmp_path / "one", 1)
    assert FilesystemResolver(LoRAResolverContext("base", None)).resolve("base", "one") is None
    assert (
        FilesystemResolver(LoRAResolverContext("base", str(tmp_path / "absent"))).resolve("base", "one")
        is None
    )
