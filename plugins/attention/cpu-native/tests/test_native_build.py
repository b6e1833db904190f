"""attention.c checked beyond its results: built with every warning an error (both builds), and
the portable kernel's contract cases (every attention kind at once; GQA, block sizes, scattered
blocks; fp8 caches) and the KV writes' tests run under AddressSanitizer and UndefinedBehaviorSanitizer."""

from pathlib import Path

import pytest

from engine.testing import native
from engine_attention_cpu_native import backend

TESTS = Path(__file__).parent


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_builds_with_every_warning_an_error(portable):
    native.build_with_warnings_as_errors(backend.SOURCE, portable)


def test_the_portable_kernel_runs_clean_under_sanitizers():
    kernel = "window-softcap-scale and batched or matches_reference or quantized"
    cases = f"TestPortableKernel and ({kernel}) or kv_write"
    native.assert_clean_under_sanitizers(
        [str(TESTS / "test_conformance.py"), str(TESTS / "test_equality.py"), "-k", cases]
    )
