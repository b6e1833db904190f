"""The quant-method kit catches the bugs quant method authors make: it runs, in a child pytest
as a plugin's tests run it, on the int8 weight-only method (which must pass every test it
runs, none skipped) and on each mutant of it in ``tests/plugins/quant_mutants.py``, each of
which must fail the test written for its bug. The tiny-model check is left out: the planted
bugs are the layer checks' to catch, and it runs in the int8 plugin's own tests."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("engine_quant_int8", reason="the int8 quant plugin is not installed")

from tests.kit_mutations import Outcomes, failed, run_kit
from tests.plugins.quant_mutants import MUTANTS  # needs the int8 plugin

KIT = textwrap.dedent("""
    from engine.plugins import add_plugin
    from engine.testing.quant import QuantMethodContract
    from tests.plugins import quant_mutants

    add_plugin(quant_mutants, "quant-mutants")
    for _name in ["int8-w8a16", *quant_mutants.MUTANTS]:
        _cls = "Test_" + _name.replace("-", "_")
        _attrs = {"method": _name, "quant_error": 0.01, "logprob_atol": 0.02}  # int8's own
        globals()[_cls] = type(_cls, (QuantMethodContract,), _attrs)
    """)
CAUGHT_BY = {  # mutant -> the kit test written for its bug
    "per-tensor-scale": "test_small_rows_keep_their_precision",
    "shards-in-arrival-order": "test_fused_shards_load_in_any_order",
    "drops-bias": "test_apply_adds_the_bias",
    "truncates": "test_rounding_is_to_nearest",
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> Outcomes:
    return run_kit(tmp_path_factory.mktemp("quant-kit"), KIT, "-k", "not tiny_model")


def test_the_kit_covers_every_mutant():
    assert set(CAUGHT_BY) == set(MUTANTS)


def test_int8_passes_every_kit_test(outcomes):
    assert outcomes["int8-w8a16"], "the kit ran no test"
    assert set(outcomes["int8-w8a16"].values()) == {"passed"}, outcomes["int8-w8a16"]


@pytest.mark.parametrize("mutant", sorted(CAUGHT_BY))
def test_each_planted_bug_fails_the_kit(outcomes, mutant):
    assert CAUGHT_BY[mutant] in failed(outcomes, mutant), f"{mutant} failed only {failed(outcomes, mutant)}"
