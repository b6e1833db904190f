"""The platform's C kernels checked beyond their results: kernels.c, quant_gemm.c, fp4_gemm.c,
dense_bf16.c and logits_int8.c built with every warning an error (both builds), each definition
checked against the prototype its header gives Python (a planted mismatch does not build), and
the tests that compare the portable build with this CPU's run under AddressSanitizer and
UndefinedBehaviorSanitizer."""

import re
import shutil
from pathlib import Path

import pytest

from engine.native import BuildError, load_source
from engine.testing import native
from engine_platforms_cpu_native import affine, dense, fp4, kernels, logits

TESTS = Path(__file__).parent
SOURCES = {
    "kernels": kernels.SOURCE,
    "quant_gemm": affine.SOURCE,
    "fp4_gemm": fp4.SOURCE,
    "dense_bf16": dense.SOURCE,
    "logits_int8": logits.SOURCE,
}


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize("name", SOURCES)
def test_builds_with_every_warning_an_error(name, portable):
    native.build_with_warnings_as_errors(SOURCES[name], portable)


def test_a_prototype_that_differs_from_its_definition_does_not_build(tmp_path, monkeypatch):
    """kernels.h as a slip would leave it, add_rms_norm_bf16's eps an integer: Python would pass
    eps in an integer register the kernel never reads. The compiler checks the definition against
    the prototype, so the library is refused."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for path in kernels.SOURCE.parent.glob("kernels*.[ch]"):
        shutil.copy(path, tmp_path)
    header = tmp_path / "kernels.h"
    planted = re.sub(r"(void add_rms_norm_bf16\([^)]*)float eps", r"\1int64_t eps", header.read_text())
    assert planted != header.read_text()
    header.write_text(planted)
    with pytest.raises(BuildError, match="conflicting types for .add_rms_norm_bf16"):
        load_source(tmp_path / "kernels.c")


def test_both_builds_run_clean_under_sanitizers():
    """The tests comparing the portable build with this CPU's (LoRA's kernels: both builds
    against the torch ops; the tile products: both against the dense weight; the int8 LM head:
    both against the plain math; the kernel's top logits and greedy tokens: both against its
    logits), both builds sanitized."""
    native.assert_clean_under_sanitizers(
        [
            str(TESTS / "test_conformance.py"),
            str(TESTS / "test_lora_kernels.py"),
            str(TESTS / "test_logits_int8.py"),
            "-k",
            " or ".join(
                ("portable_build", "match_the_torch_ops", "tile_product", "tiled_bf16", "plain_math")
                + ("kernels_top", "kernels_greedy")
            ),
        ]
    )
