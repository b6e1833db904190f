"""The drafter kit catches the bugs drafter authors make: it runs, in a child pytest as a
plugin's tests run it, on the ngram drafter (which must pass every test it runs, none skipped)
and on each mutant of it in ``tests/plugins/drafter_mutants.py``, each of which must fail the
test written for its bug. To keep it short, the requests generate 12 tokens, the greedy-output
test (which the drafters' own tests run) is left out, so the interface checks record a run of
their own, and seeded sampling runs on ngram and the mutant written for it only."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("engine_spec_ngram", reason="the ngram drafter plugin is not installed")

from tests.kit_mutations import Outcomes, failed, run_kit
from tests.plugins.drafter_mutants import MUTANTS  # needs the ngram plugin

KIT = textwrap.dedent("""
    from engine.plugins import add_plugin
    from engine.testing.spec import DrafterContract
    from tests.plugins import drafter_mutants

    add_plugin(drafter_mutants, "drafter-mutants")
    for _name in ["ngram", *drafter_mutants.MUTANTS]:
        _cls = "Test_" + _name.replace("-", "_")
        _config = {"method": _name, "num_speculative_tokens": 4, "prompt_lookup_max": 3}
        globals()[_cls] = type(_cls, (DrafterContract,), {"speculative_config": _config, "new_tokens": 12})
    """)
CAUGHT_BY = {  # mutant -> the kit test written for its bug
    "ignores-room": "test_proposals_keep_the_interface[drafts-fit-their-room]",
    "drops-empty-drafts": "test_proposals_keep_the_interface[one-draft-per-request]",
    "pads-with-minus-one": "test_proposals_keep_the_interface[ids-in-the-vocabulary]",
    "random-occurrence": "test_seeded_sampling_runs_to_length",
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> Outcomes:
    tests = "proposals_keep_the_interface or (seeded_sampling and (ngram or random_occurrence))"
    return run_kit(tmp_path_factory.mktemp("drafter-kit"), KIT, "-k", tests)


def test_the_kit_covers_every_mutant():
    assert set(CAUGHT_BY) == set(MUTANTS)


def test_ngram_passes_every_kit_test(outcomes):
    assert outcomes["ngram"], "the kit ran no test"
    assert set(outcomes["ngram"].values()) == {"passed"}, outcomes["ngram"]


@pytest.mark.parametrize("mutant", sorted(CAUGHT_BY))
def test_each_planted_bug_fails_the_kit(outcomes, mutant):
    assert CAUGHT_BY[mutant] in failed(outcomes, mutant), f"{mutant} failed only {failed(outcomes, mutant)}"
