"""The layer-ops kit catches the bugs platform authors make: it runs, in a child pytest as a
platform's tests run it, on the plain CPU platform's ops and on each mutant platform in
``tests/plugins/layer_ops_mutants.py`` (the plain ops with one op rewritten wrongly), each of
which must fail the test written for its bug. To stay fast the child runs only those tests:
each mutant its own, the CPU platform every one of them, which it must pass (the whole kit runs
on real overrides in the cpu-native platform's tests)."""

from __future__ import annotations

import textwrap

import pytest

from tests.kit_mutations import Outcomes, class_name, failed, run_kit
from tests.plugins.layer_ops_mutants import MUTANTS

CORRECT = "cpu"
KIT = textwrap.dedent("""
    from engine.plugins import add_plugin
    from engine.testing.layer_ops import LayerOpsContract
    from tests.plugins import layer_ops_mutants

    add_plugin(layer_ops_mutants, "layer-ops-mutants")
    for _name in ["cpu", *layer_ops_mutants.MUTANTS]:
        _cls = "Test_" + _name.replace("-", "_")
        globals()[_cls] = type(_cls, (LayerOpsContract,), {"platform_name": _name})
    """)
CAUGHT_BY = {  # mutant -> the kit test written for its bug
    "stale-residual": "test_rms_norm[100-True-5-bf16]",
    "eps-outside-the-root": "test_rms_norm_of_small_and_zero_rows[False-fp32]",
    "norm-in-place": "test_rms_norm_of_head_views[scattered-heads-5-bf16]",
    "rotate-half-twice": "test_rotary_qkv[64-0-5-bf16]",
    "unstrided-rotary": "test_rotary_qkv[64-64-5-fp32]",
    "pairs-as-halves": "test_partial_rotary_qkv[pairs-0-5-fp32]",
    "shared-qk-norm": "test_qk_norm_rotary[64-0-5-fp32]",
    "swapped-swiglu": "test_silu_and_mul[0-5-bf16]",
    "per-tensor-int8": "test_quantize_rows_int8[0-100-False-5-fp32]",
    "outliers-in-the-scale": "test_quantize_rows_int8[0-100-True-1-bf16]",
    "truncating-int8": "test_quantize_rows_int8[0-700-False-5-fp32]",
    "exact-group-sums": "test_pack_affine_rounding_meets_the_weight[4]",
    "none-is-the-last-slot": "test_lora_shrink_expand[qkv-5-fp32-mixed]",
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> Outcomes:
    own = [f"({class_name(mutant)} and {test})" for mutant, test in CAUGHT_BY.items()]
    correct = [f"({class_name(CORRECT)} and {test})" for test in set(CAUGHT_BY.values())]
    return run_kit(tmp_path_factory.mktemp("layer-ops-kit"), KIT, "-k", " or ".join(own + correct))


def test_the_kit_covers_every_mutant():
    assert set(CAUGHT_BY) == set(MUTANTS)


def test_the_cpu_platform_passes_every_test_a_mutant_fails(outcomes):
    assert set(outcomes[CORRECT]) == set(CAUGHT_BY.values()), "a test in CAUGHT_BY is not the kit's"
    assert set(outcomes[CORRECT].values()) == {"passed"}, outcomes[CORRECT]


@pytest.mark.parametrize("mutant", sorted(CAUGHT_BY))
def test_each_planted_bug_fails_the_kit(outcomes, mutant):
    assert CAUGHT_BY[mutant] in failed(outcomes, mutant), f"{mutant} failed only {failed(outcomes, mutant)}"
