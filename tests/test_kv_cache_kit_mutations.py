"""The KV cache manager kit catches the bugs manager authors make: it runs, in a child pytest as
a plugin's tests run it, on the built-in manager (which must pass every test) and on each mutant
of it in ``tests/plugins/kv_cache_mutants.py``, each of which must fail the test written for its
bug. The mutants run only the kit's small tests (its random workloads catch most of them too,
but shrinking each failure takes a minute of the suite's time)."""

from __future__ import annotations

import textwrap

import pytest

from tests.kit_mutations import Outcomes, failed, run_kit
from tests.plugins.kv_cache_mutants import MUTANTS

KIT = textwrap.dedent("""
    from engine.plugins import add_plugin
    from engine.testing.kv_cache import KVCacheManagerContract
    from tests.plugins import kv_cache_mutants

    add_plugin(kv_cache_mutants, "kv-cache-mutants")
    for _name in ["default", *kv_cache_mutants.MUTANTS]:
        _cls = "Test_" + _name.replace("-", "_")
        globals()[_cls] = type(_cls, (KVCacheManagerContract,), {"manager_name": _name})
    """)
CAUGHT_BY = {  # mutant -> the kit test written for its bug
    "no-rollback": "test_a_failed_allocation_keeps_nothing_it_took",
    "frees-shared-blocks": "test_a_block_stays_while_another_request_holds_it",
    "hash-ignores-parent": "test_equal_blocks_after_different_prefixes_do_not_hit",
    "caches-uncomputed-blocks": "test_blocks_a_chunk_has_not_computed_do_not_hit",
    "window-drops-read-blocks": "test_a_sliding_window_drops_exactly_the_blocks_it_passed",
    "window-keeps-passed-blocks": "test_a_sliding_window_drops_exactly_the_blocks_it_passed",
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> Outcomes:
    only = "Test_default or not (random_workload or kv_events)"
    return run_kit(tmp_path_factory.mktemp("kv-cache-kit"), KIT, "-k", only)


def test_the_kit_covers_every_mutant():
    assert set(CAUGHT_BY) == set(MUTANTS)


def test_the_builtin_manager_passes_every_kit_test(outcomes):
    assert len(outcomes["default"]) > len(outcomes["no-rollback"]), "the kit did not run whole on it"
    assert set(outcomes["default"].values()) == {"passed"}, outcomes["default"]


@pytest.mark.parametrize("mutant", sorted(CAUGHT_BY))
def test_each_planted_bug_fails_the_kit(outcomes, mutant):
    assert CAUGHT_BY[mutant] in failed(outcomes, mutant), f"{mutant} failed only {failed(outcomes, mutant)}"
