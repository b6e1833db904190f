"""The scheduler kit catches the bugs scheduler authors make: it runs, in a child pytest as a
plugin's tests run it, on the built-in scheduler (which must pass every test) and on each mutant
of it in ``tests/plugins/scheduler_mutants.py``, each of which must fail the test written for its
bug. The mutants run only the kit's small tests (its random workloads catch most of them too,
but shrinking each failure takes the suite's time)."""

from __future__ import annotations

import textwrap

import pytest

from tests.kit_mutations import Outcomes, failed, run_kit
from tests.plugins.scheduler_mutants import MUTANTS

KIT = textwrap.dedent("""
    from engine.plugins import add_plugin
    from engine.testing.scheduler import SchedulerContract
    from tests.plugins import scheduler_mutants

    add_plugin(scheduler_mutants, "scheduler-mutants")
    for _name in ["default", *scheduler_mutants.MUTANTS]:
        _cls = "Test_" + _name.replace("-", "_")
        globals()[_cls] = type(_cls, (SchedulerContract,), {"scheduler_name": _name})
    """)
CAUGHT_BY = {  # mutant -> the kit test written for its bug
    "decodes-off-budget": "test_decode_tokens_count_against_the_budget",
    "drafts-off-budget": "test_draft_tokens_count_against_the_budget",
    "one-seq-too-many": "test_no_more_requests_run_than_max_num_seqs",
    "drops-preempted": "test_small_pool_forces_preemption_without_changing_outputs",
    "preempt-keeps-count": "test_small_pool_forces_preemption_without_changing_outputs",
    "abort-forgets-waiting": "test_an_aborted_waiting_request_leaves_the_queue",
    "lora-unlimited": "test_lora_steps_stay_within_max_loras",
    "lora-blocks-the-queue": "test_a_request_whose_adapter_must_wait_holds_up_no_one",
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> Outcomes:
    only = "Test_default or not random_workloads"
    return run_kit(tmp_path_factory.mktemp("scheduler-kit"), KIT, "-k", only)


def test_the_kit_covers_every_mutant():
    assert set(CAUGHT_BY) == set(MUTANTS)


def test_the_builtin_scheduler_passes_every_kit_test(outcomes):
    assert len(outcomes["default"]) > len(outcomes["drops-preempted"]), "the kit did not run whole on it"
    assert set(outcomes["default"].values()) == {"passed"}, outcomes["default"]


@pytest.mark.parametrize("mutant", sorted(CAUGHT_BY))
def test_each_planted_bug_fails_the_kit(outcomes, mutant):
    assert CAUGHT_BY[mutant] in failed(outcomes, mutant), f"{mutant} failed only {failed(outcomes, mutant)}"
