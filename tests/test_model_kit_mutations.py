"""The model kit catches the bugs model authors make: it runs, in a child pytest as a plugin's
tests run it, on the Llama model (which must pass every test it runs, none skipped) and on each
mutant of it in ``tests/plugins/model_mutants.py``, each of which must fail the test written
for its bug. Only the declaration and log-prob checks run: the planted bugs are numeric, the
log-prob check's to catch, and the llama plugin's own tests run the rest of the kit."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("engine_models_llama", reason="the llama model plugin is not installed")

from tests.kit_mutations import Outcomes, failed, run_kit
from tests.plugins.model_mutants import MUTANTS  # needs the llama plugin

KIT = textwrap.dedent("""
    from engine.plugins import add_plugin
    from engine.testing.models import ModelContract
    from tests.plugins import model_mutants

    add_plugin(model_mutants, "model-mutants")
    for _name, _model in [("llama", "Llama"), *((n, m.__name__) for n, m in model_mutants.MUTANTS.items())]:
        _cls = "Test_" + _name.replace("-", "_")
        _attrs = {"model_class": "tests.plugins.model_mutants:" + _model, "new_tokens": 6}
        globals()[_cls] = type(_cls, (ModelContract,), _attrs)
    """)
CAUGHT_BY = {  # mutant -> the kit test written for its bug
    "rope-base-10000": "test_logprobs_and_greedy_match_transformers",
    "rope-scaling-ignored": "test_logprobs_and_greedy_match_transformers",
    "eps-hard-coded": "test_logprobs_and_greedy_match_transformers",
    "k-v-swapped": "test_logprobs_and_greedy_match_transformers",
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> Outcomes:
    return run_kit(tmp_path_factory.mktemp("model-kit"), KIT, "-k", "declares or logprobs")


def test_the_kit_covers_every_mutant():
    assert set(CAUGHT_BY) == set(MUTANTS)


def test_llama_passes_every_kit_test(outcomes):
    assert outcomes["llama"], "the kit ran no test"
    assert set(outcomes["llama"].values()) == {"passed"}, outcomes["llama"]


@pytest.mark.parametrize("mutant", sorted(CAUGHT_BY))
def test_each_planted_bug_fails_the_kit(outcomes, mutant):
    assert CAUGHT_BY[mutant] in failed(outcomes, mutant), f"{mutant} failed only {failed(outcomes, mutant)}"
