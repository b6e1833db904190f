"""The LoRA resolver kit catches the bugs resolver authors make: it runs, in a child pytest as a
plugin's tests run it, on the filesystem resolver (which must pass every test, none skipped)
and on each mutant of it in ``tests/plugins/lora_resolver_mutants.py``, each of which must fail
the test written for its bug."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("engine_loraresolvers_filesystem", reason="the filesystem LoRA resolver is not installed")

from tests.kit_mutations import Outcomes, failed, run_kit
from tests.plugins.lora_resolver_mutants import MUTANTS  # needs the filesystem resolver

KIT = textwrap.dedent("""
    from engine.plugins import add_plugin
    from engine.testing.lora_resolver import LoRAResolverContract
    from tests.plugins import lora_resolver_mutants

    add_plugin(lora_resolver_mutants, "lora-resolver-mutants")
    for _name in ["filesystem", *lora_resolver_mutants.MUTANTS]:
        _cls = "Test_" + _name.replace("-", "_")
        globals()[_cls] = type(_cls, (LoRAResolverContract,), {"resolver_name": _name})
    """)
CAUGHT_BY = {  # mutant -> the kit test written for its bug
    "joins-blindly": "test_an_unknown_name_is_none",
    "no-containment": "test_names_that_leave_the_store_are_none",
    "raises-on-unknown": "test_an_unknown_name_is_none",
    "any-folder": "test_an_entry_that_is_no_lora_adapter_is_none",
    "first-adapter": "test_each_name_resolves_to_its_own_adapter",
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> Outcomes:
    return run_kit(tmp_path_factory.mktemp("lora-resolver-kit"), KIT)


def test_the_kit_covers_every_mutant():
    assert set(CAUGHT_BY) == set(MUTANTS)


def test_filesystem_passes_every_kit_test(outcomes):
    assert outcomes["filesystem"], "the kit ran no test"
    assert set(outcomes["filesystem"].values()) == {"passed"}, outcomes["filesystem"]


@pytest.mark.parametrize("mutant", sorted(CAUGHT_BY))
def test_each_planted_bug_fails_the_kit(outcomes, mutant):
    assert CAUGHT_BY[mutant] in failed(outcomes, mutant), f"{mutant} failed only {failed(outcomes, mutant)}"
