"""The attention kit catches the bugs attention backend authors make: it runs, in a child pytest
as a backend's tests run it, on the torch backend and on each mutant of it in
``tests/plugins/attention_mutants.py``, each of which must fail the test written for its bug.
To stay fast the child runs only those tests: each mutant its own, the torch backend every one
of them, which it must pass (its whole kit runs in the torch plugin's tests) — but the
``chunk_invariant`` test, which the torch backend (not declaring it) skips: the cpu-native
backend, which declares it, must pass that one."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("engine_attention_torch", reason="the torch attention plugin is not installed")
pytest.importorskip("engine_attention_cpu_native", reason="the cpu-native attention plugin is not installed")

from tests.kit_mutations import Outcomes, class_name, failed, run_kit
from tests.plugins.attention_mutants import MUTANTS  # needs the torch attention plugin

CORRECT = "torch"
CHUNK_INVARIANT = "cpu-native"  # the correct backend for the chunk_invariant test
KIT = textwrap.dedent("""
    from engine.plugins import add_plugin
    from engine.testing.attention import AttentionBackendContract
    from tests.plugins import attention_mutants

    add_plugin(attention_mutants, "attention-mutants")
    for _name in ["torch", "cpu-native", *attention_mutants.MUTANTS]:
        _cls = "Test_" + _name.replace("-", "_")
        globals()[_cls] = type(_cls, (AttentionBackendContract,), {"backend_name": _name})
    """)
CAUGHT_BY = {  # mutant -> the kit test written for its bug
    "top-left-causal": "test_matches_reference[chunked-prefill-8-fp32-mha]",
    "modulo-heads": "test_matches_reference[decode-8-fp32-gqa]",
    "consecutive-blocks": "test_matches_reference[decode-single-8-fp32-mha]",
    "window-by-blocks": "test_attention_kinds_match_reference[decode-window-fp32-batched]",
    "window-one-wider": "test_attention_kinds_match_reference[chunked-prefill-window-fp32-batched]",
    "decode-without-softcap": "test_attention_kinds_match_reference[decode-softcap-fp32-batched]",
    "default-scale": "test_attention_kinds_match_reference[prefill-scale-fp32-batched]",
    "gather-once-per-step": "test_layers_share_one_steps_metadata[8-fp32-decode]",
    "always-causal": "test_bidirectional[fp32-prefill]",
    "claims-chunk-invariance": "test_chunk_invariant[8-fp32]",
    "ignores-kv-scale": "test_quantized_kv_cache[fp32-decode-fp8_e4m3]",
    "decode-without-sinks": "test_attention_kinds_match_reference[decode-window-sinks-fp32-batched]",
}


def correct_for(test: str) -> str:
    return CHUNK_INVARIANT if test.startswith("test_chunk_invariant") else CORRECT


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> Outcomes:
    own = [f"({class_name(mutant)} and {test})" for mutant, test in CAUGHT_BY.items()]
    correct = [f"({class_name(correct_for(test))} and {test})" for test in set(CAUGHT_BY.values())]
    return run_kit(tmp_path_factory.mktemp("attention-kit"), KIT, "-k", " or ".join(own + correct))


def test_the_kit_covers_every_mutant():
    assert set(CAUGHT_BY) == set(MUTANTS)


def test_the_correct_backends_pass_every_test_a_mutant_fails(outcomes):
    ran = {test for backend in (CORRECT, CHUNK_INVARIANT) for test in outcomes[backend]}
    assert ran == set(CAUGHT_BY.values()), "a test in CAUGHT_BY is not the kit's"
    for backend in (CORRECT, CHUNK_INVARIANT):
        assert set(outcomes[backend].values()) == {"passed"}, outcomes[backend]


@pytest.mark.parametrize("mutant", sorted(CAUGHT_BY))
def test_each_planted_bug_fails_the_kit(outcomes, mutant):
    assert CAUGHT_BY[mutant] in failed(outcomes, mutant), f"{mutant} failed only {failed(outcomes, mutant)}"
