"""Checks for a plugin's C kernels (:mod:`engine.native`) beyond their results: built with every
warning an error, and run under AddressSanitizer and UndefinedBehaviorSanitizer::

    from engine.testing import native

    def test_builds_with_every_warning_an_error():
        native.build_with_warnings_as_errors(SOURCE, portable=True)

    def test_kernels_run_clean_under_sanitizers():
        native.assert_clean_under_sanitizers([str(TESTS / "test_kernels.py"), "-k", "portable"])

The sanitizer run is a child pytest whose every native build gets :data:`SANITIZER_FLAGS`
(through ``$ENGINE_NATIVE_CFLAGS``) and whose interpreter preloads the compiler's ASan runtime,
which must come before every other library; leaks are not reported (the interpreter's own are
many). It skips where the compiler has no ASan runtime.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.native import CFLAGS_VARIABLE, Library, load_source

# -Wmissing-prototypes: an exported function its header does not declare
WARNING_FLAGS = ("-Wall", "-Wextra", "-Werror", "-Wmissing-prototypes")
SANITIZER_FLAGS = (
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
    "-g",
)


def build_with_warnings_as_errors(source: Path, portable: bool = False) -> Library:
    """``source`` built with :data:`WARNING_FLAGS` (a :class:`~engine.native.BuildError` lists
    the warnings)."""
    return load_source(source, portable=portable, extra_flags=WARNING_FLAGS)


def asan_runtime() -> str | None:
    """The system compiler's shared AddressSanitizer runtime, or None."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    path = subprocess.run(
        [compiler, "-print-file-name=libasan.so"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


def run_under_sanitizers(pytest_args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """pytest on ``pytest_args`` in a child whose native libraries are built with
    :data:`SANITIZER_FLAGS`; skips the calling test where there is no ASan runtime."""
    runtime = asan_runtime()
    if runtime is None:
        pytest.skip("the C compiler has no AddressSanitizer runtime (libasan.so)")
    env = dict(
        os.environ,
        LD_PRELOAD=runtime,
        ASAN_OPTIONS="detect_leaks=0",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
    )
    env[CFLAGS_VARIABLE] = " ".join(SANITIZER_FLAGS)
    # --capture=sys: a report the sanitizer writes to file descriptor 2 before it exits is not lost
    # in pytest's capture file
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        "--capture=sys",
        *pytest_args,
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def assert_clean_under_sanitizers(pytest_args: list[str], timeout: float = 600) -> None:
    """The tests ``pytest_args`` select pass, at least one, under the sanitizers (a finding
    fails the child, whose output's end this assertion shows)."""
    done = run_under_sanitizers(pytest_args, timeout)
    tail = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, f"under sanitizers, pytest {' '.join(pytest_args)} failed:\n{tail}"
    assert " passed" in done.stdout, f"under sanitizers, pytest {' '.join(pytest_args)} ran nothing:\n{tail}"
