"""The KV connector kit catches the bugs KV connector authors make: it runs, in a child pytest as
a plugin's tests run it, on the test memory connector (synchronous and asynchronous) and the
offload connector (which must pass every test) and on each mutant of them in
``tests/plugins/kv_connector_mutants.py``, each of which must fail the test written for its bug.
The P/D kit likewise, on the p2p connector and its mutants in ``tests/plugins/pd_connector_mutants.py``,
in the test for their bug only: the others would wait out the abort timeout the bug leaves."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("engine_kvconnectors_offload", reason="the offload plugin is not installed")

from tests.kit_mutations import Outcomes, failed, run_kit
from tests.plugins import kv_connector_mutants  # needs the offload plugin

# Examples derandomized and not shrunk: a failing mutant's first failing example is enough, and
# shrinking it would take minutes.
KIT = textwrap.dedent("""
    from hypothesis import Phase, settings

    settings.register_profile("kit", derandomize=True, database=None, phases=[Phase.explicit, Phase.generate])
    settings.load_profile("kit")  # before the kit's tests take their settings

    from engine.plugins import add_plugin
    from engine.testing.{kit} import {contract}
    from tests.plugins import {module}

    add_plugin({module}, "{module}")
    for _name in [*{module}.CORRECT, *{module}.MUTANTS]:
        _cls = "Test_" + _name.replace("-", "_")
        globals()[_cls] = type(_cls, ({contract},), {{"connector_name": _name}})
    """)
CAUGHT_BY = {  # mutant -> the kit test written for its bug
    "loads-from-table-start": "test_a_prefix_partly_in_the_pool_loads_only_the_rest",
    "counts-the-local-hit": "test_a_prefix_partly_in_the_pool_loads_only_the_rest",
    "first-layer-only": "test_round_trip_into_other_blocks_after_eviction",
    "idle-steps-land-nothing": "test_round_trip_into_other_blocks_after_eviction",
    "saves-after-the-free": "test_blocks_reused_right_after_a_finish_were_saved_first",
    "never-sent": "test_random_workloads_leak_no_blocks",
}
PD_CAUGHT_BY = {"silent-release": "test_the_producer_frees_the_blocks_once_they_are_pulled"}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> Outcomes:
    source = KIT.format(kit="kv_connector", contract="KVConnectorContract", module="kv_connector_mutants")
    return run_kit(tmp_path_factory.mktemp("kv-connector-kit"), source)


@pytest.fixture(scope="module")
def pd_outcomes(tmp_path_factory) -> Outcomes:
    pytest.importorskip("engine_kvconnectors_p2p", reason="the p2p plugin is not installed")
    source = KIT.format(kit="pd_connector", contract="PDConnectorContract", module="pd_connector_mutants")
    tests = " or ".join(sorted(set(PD_CAUGHT_BY.values())))
    return run_kit(tmp_path_factory.mktemp("pd-connector-kit"), source, "-k", tests)


def test_the_kit_covers_every_mutant():
    assert set(CAUGHT_BY) == set(kv_connector_mutants.MUTANTS)


@pytest.mark.parametrize("connector", sorted(kv_connector_mutants.CORRECT))
def test_the_correct_connectors_pass_every_kit_test(outcomes, connector):
    assert outcomes[connector], "the kit ran no test"
    assert set(outcomes[connector].values()) == {"passed"}, outcomes[connector]


@pytest.mark.parametrize("mutant", sorted(CAUGHT_BY))
def test_each_planted_bug_fails_the_kit(outcomes, mutant):
    assert CAUGHT_BY[mutant] in failed(outcomes, mutant), f"{mutant} failed only {failed(outcomes, mutant)}"


def test_the_pd_kit_passes_p2p_and_fails_each_planted_bug(pd_outcomes):
    from tests.plugins import pd_connector_mutants

    assert set(PD_CAUGHT_BY) == set(pd_connector_mutants.MUTANTS)
    for connector in pd_connector_mutants.CORRECT:
        assert set(pd_outcomes[connector].values()) == {"passed"}, pd_outcomes[connector]
    for mutant, test in PD_CAUGHT_BY.items():
        assert test in failed(pd_outcomes, mutant), f"{mutant} failed only {failed(pd_outcomes, mutant)}"
