"""engine.native's checked bindings: a library's functions typed from its prototype header, a
header that differs from the C definitions refused at build time, the tape interpreter built with
every warning an error, and the sanitizer run that the plugins' kernel tests use shown to catch a
planted overflow."""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import pytest
import torch

from engine import lifetime
from engine.native import BuildError, HeaderError, load_source, rows, tape
from engine.native.prototypes import Prototype, read_header
from engine.testing import native

TESTS = Path(__file__).parent
HEADER = """#ifndef TINY_H
#define TINY_H
#include "engine_native.h"
/* a comment; with a semicolon */
int64_t count(void);
void scale(float *out, const float *x, int64_t n, float by);  // trailing comment
engine_status check(const int64_t *ids,
                    int64_t n);
#endif
"""
SOURCE = """#include "tiny.h"
int64_t count(void) { return 3; }
void scale(float *out, const float *x, int64_t n, float by) {
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * by;
}
engine_status check(const int64_t *ids, int64_t n) { return n > 0 && ids[0] < 0; }
"""


def _library(folder: Path, header: str = HEADER, source: str = SOURCE) -> Path:
    (folder / "tiny.h").write_text(header)
    (folder / "tiny.c").write_text(source)
    return folder / "tiny.c"


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """The tiny libraries are built into the test's own cache, not the user's. The tests that
    build the engine's own sources keep the user's cache: the sanitized build of the platform's
    kernels (minutes under load) is the one the platform's own sanitizer test replays."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_a_header_gives_each_function_its_ctypes_types(tmp_path):
    _library(tmp_path)
    assert read_header(tmp_path / "tiny.h") == {
        "count": Prototype("count", (), ctypes.c_int64, False),
        "scale": Prototype(
            "scale", (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float), None, False
        ),
        "check": Prototype("check", (ctypes.c_void_p, ctypes.c_int64), ctypes.c_int64, True),
    }


@pytest.mark.parametrize(
    ("statement", "reason"),
    [
        ("double mean(const float *x, int64_t n);", "mean returns double"),
        ("void fill(float *x, int n);", "fill's parameter 'int n' is not an int64_t, a float or a pointer"),
        ("typedef struct { int64_t a; } pair;", "is not a prototype"),
        ("void last(void)", "does not end with ';'"),
    ],
)
def test_what_the_header_reader_does_not_take_is_refused_with_the_statement(tmp_path, statement, reason):
    (tmp_path / "bad.h").write_text(f'#include "engine_native.h"\n{statement}\n')
    with pytest.raises(HeaderError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        read_header(tmp_path / "bad.h")


@pytest.mark.usefixtures("private_cache")
def test_calls_are_checked_against_the_prototypes(tmp_path):
    """Arguments convert by the header's types (a wrong one is refused before C sees it), a status
    result is an int, and a symbol the header does not declare cannot be called at all."""
    library = load_source(_library(tmp_path))
    x, out = (ctypes.c_float * 3)(1, 2, 3), (ctypes.c_float * 3)()
    library.scale(ctypes.addressof(out), ctypes.addressof(x), 3, 0.5)
    assert list(out) == [0.5, 1.0, 1.5] and library.count() == 3
    ids = (ctypes.c_int64 * 1)(-1)
    assert library.check(ctypes.addressof(ids), 1) == 1
    with pytest.raises(ctypes.ArgumentError):
        library.scale(ctypes.addressof(out), ctypes.addressof(x), 1.5, 0.5)
    with pytest.raises(TypeError):
        library.scale(ctypes.addressof(out), 3)
    with pytest.raises(AttributeError, match="printf is not declared in tiny.h"):
        library.printf  # noqa: B018


@pytest.mark.parametrize(
    ("header", "source", "error"),
    [
        # the prototype Python binds says float, the definition takes an integer
        (
            HEADER.replace("int64_t n, float by", "int64_t n, int64_t by"),
            SOURCE,
            "conflicting types for .scale",
        ),
        (
            HEADER,
            SOURCE.replace("engine_status check(const int64_t *ids", "engine_status check(int64_t *ids"),
            "conflicting types for .check",
        ),
        # the source forgets its header: it is force-included all the same
        (
            HEADER.replace("const float *x, int64_t n", "float *x, int64_t n"),
            SOURCE.replace('#include "tiny.h"\n', ""),
            "conflicting types for .scale",
        ),
    ],
)
@pytest.mark.usefixtures("private_cache")
def test_a_header_that_differs_from_the_definitions_does_not_build(tmp_path, header, source, error):
    with pytest.raises(BuildError, match=error):
        load_source(_library(tmp_path, header, source))


@pytest.mark.usefixtures("private_cache")
def test_a_declared_function_must_be_defined_and_an_exported_one_declared(tmp_path):
    missing = HEADER.replace("#endif", "void forgotten(float *x);\n#endif")
    with pytest.raises(BuildError, match="tiny.h declares what tiny.c does not define: forgotten"):
        load_source(_library(tmp_path, header=missing))
    undeclared = SOURCE + "int64_t extra(int64_t n) { return n; }\n"
    load_source(_library(tmp_path, source=undeclared))  # ctypes could not call it anyway
    with pytest.raises(BuildError, match="no previous prototype for .extra"):
        native.build_with_warnings_as_errors(_library(tmp_path, source=undeclared))


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize("source", [tape.SOURCE, rows.SOURCE], ids=["tape", "rows"])
def test_the_cores_kernels_build_with_every_warning_an_error(source, portable):
    native.build_with_warnings_as_errors(source, portable)


@pytest.mark.usefixtures("private_cache")
def test_the_sanitizer_run_catches_a_planted_overflow(tmp_path):
    """What the plugins' sanitizer tests rely on: a child pytest whose kernel writes one float
    past a tensor fails with AddressSanitizer's report."""
    source = _library(tmp_path, source=SOURCE.replace("i < n; i++) out[i]", "i <= n; i++) out[i]"))
    (tmp_path / "test_overflow.py").write_text(f"""
from pathlib import Path
import torch
from engine.native import load_source

def test_scale():
    x, out = torch.zeros(4), torch.empty(4)
    load_source(Path({str(source)!r})).scale(out.data_ptr(), x.data_ptr(), 4, 1.0)
""")
    done = native.run_under_sanitizers([str(tmp_path / "test_overflow.py")], timeout=300)
    assert done.returncode != 0 and "AddressSanitizer: heap-buffer-overflow" in done.stdout + done.stderr


def test_recorded_kernels_replay_clean_under_sanitizers():
    native.assert_clean_under_sanitizers(
        [str(TESTS / "test_native_tape.py"), "-k", "replay_runs or refusing"]
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_the_libc_call_outside_engine_native_is_typed_and_checked():
    """engine.lifetime's prctl: a refused option raises, where an untyped call returned -1 unseen."""
    with pytest.raises(OSError, match="Invalid argument"):
        lifetime._prctl()(-1, ctypes.c_ulong(0))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_kernels_run_on_torchs_openmp_runtime(tmp_path):
    """A kernel library's libgomp resolves to the copy torch loaded: one OpenMP runtime and one
    thread pool in the process, sized by ``torch.set_num_threads`` (a second runtime would keep
    its own team size, the core count, whatever torch is set to)."""
    header = '#include "engine_native.h"\nint64_t team_size(void);\n'
    source = """#include <omp.h>
int64_t team_size(void) {
    int64_t size = 0;
#pragma omp parallel
#pragma omp single
    size = omp_get_num_threads();
    return size;
}
"""
    library = load_source(_library(tmp_path, header, source))
    threads = torch.get_num_threads()
    try:
        for count in (1, os.cpu_count() + 1):
            torch.set_num_threads(count)
            assert library.team_size() == count
    finally:
        torch.set_num_threads(threads)
    with open("/proc/self/maps") as maps:
        runtimes = {os.path.realpath(line.split()[-1]) for line in maps if "libgomp" in line}
    assert runtimes == {os.path.realpath(Path(torch.__file__).parent / "lib" / "libgomp.so.1")}
