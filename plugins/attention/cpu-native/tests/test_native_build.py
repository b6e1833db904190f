"""attention.c and mla.c checked beyond their results: built with every warning an error (both
builds), and the portable kernels' contract cases (every attention kind at once; GQA, block sizes,
scattered blocks; fp8 caches; MLA's latent decode) and the KV writes' tests run under
AddressSanitizer and UndefinedBehaviorSanitizer."""

from pathlib import Path

import pytest

from engine.testing import native
from engine_attention_cpu_native import backend, mla

TESTS = Path(__file__).parent


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize("source", [backend.SOURCE, mla.SOURCE], ids=["attention", "mla"])
def test_builds_with_every_warning_an_error(source, portable):
    native.build_with_warnings_as_errors(source, portable)


def test_the_portable_kernel_runs_clean_under_sanitizers():
    kernel = "window-softcap-scale and batched or matches_reference or quantized"
    cases = f"TestPortableKernel and ({kernel}) or kv_write"
    native.assert_clean_under_sanitizers(
        [str(TESTS / "test_conformance.py"), str(TESTS / "test_equality.py"), "-k", cases]
    )


def test_the_mla_kernels_run_clean_under_sanitizers():
    """Both MLA kernels on plain math, and the portable one through the latent contract."""
    cases = "TestMLAPortableKernel and (wide or matches_reference) or test_matches_plain_math"
    native.assert_clean_under_sanitizers(
        [str(TESTS / "test_mla_conformance.py"), str(TESTS / "test_mla_kernel.py"), "-k", cases]
    )
