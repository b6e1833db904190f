"""The grammar kit catches the bugs grammar backend authors make: it runs, in a child pytest as
a plugin's tests run it, on the xgrammar and llguidance backends (which must pass every test,
none skipped) and on each mutant in ``tests/plugins/grammar_mutants.py``, each of which must
fail the test written for its bug."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("engine_grammar_xgrammar", reason="the xgrammar plugin is not installed")
pytest.importorskip("engine_grammar_llguidance", reason="the llguidance plugin is not installed")

from tests.kit_mutations import Outcomes, failed, run_kit
from tests.plugins.grammar_mutants import MUTANTS  # needs the xgrammar and llguidance plugins

KIT = textwrap.dedent("""
    from engine.plugins import add_plugin
    from engine.testing.grammar import GrammarBackendContract
    from tests.plugins import grammar_mutants

    add_plugin(grammar_mutants, "grammar-mutants")
    for _name in ["xgrammar", "llguidance", *grammar_mutants.MUTANTS]:
        _cls = "Test_" + _name.replace("-", "_")
        globals()[_cls] = type(_cls, (GrammarBackendContract,), {"backend_name": _name})
    """)
CAUGHT_BY = {  # mutant -> the kit test written for its bug
    "or-bits": "test_fill_bitmask_writes_the_whole_row",
    "tokenizer-width": "test_random_walks_produce_valid_output[choice]",
    "ends-when-it-could": "test_longer_matches_stay_reachable[choice]",
    "json-any-value": "test_json_object_is_an_object",
    "partial-accept": "test_disallowed_tokens_are_refused_without_change",
    "reset-keeps-state": "test_reset_returns_to_the_start",
    "eos-flag": "test_rollback_restores_the_mask_also_past_eos",
    "shared-grammar": "test_each_compile_is_a_grammar_of_its_own",
    "eos-never-recorded": "test_rollback_of_eos_where_the_output_could_go_on",
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> Outcomes:
    return run_kit(tmp_path_factory.mktemp("grammar-kit"), KIT)


def test_the_kit_covers_every_mutant():
    assert set(CAUGHT_BY) == set(MUTANTS)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_the_real_backends_pass_every_kit_test(outcomes, backend):
    assert outcomes[backend], "the kit ran no test"
    assert set(outcomes[backend].values()) == {"passed"}, outcomes[backend]


@pytest.mark.parametrize("mutant", sorted(CAUGHT_BY))
def test_each_planted_bug_fails_the_kit(outcomes, mutant):
    assert CAUGHT_BY[mutant] in failed(outcomes, mutant), f"{mutant} failed only {failed(outcomes, mutant)}"
