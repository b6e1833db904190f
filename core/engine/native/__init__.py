"""Compile a plugin's C source once per machine with the system C compiler and load it.

Plugins with C kernels (the cpu-native platform's ops, the cpu-native attention backend) build
them here rather than each carrying a build step. Sources may ``#include`` from
:data:`INCLUDE_DIR` what every kernel needs, written once: ``engine_bf16.h`` (the bfloat16
conversions), ``engine_exp.h`` (exp on vector lanes), ``engine_lanes.h`` (sum and max across
an AVX2 vector's lanes), ``engine_split.h`` (a loop over rows split over the threads only
where a call is big enough).

A library ``name.c`` comes with its prototype header ``name.h`` (:mod:`engine.native.prototypes`):
the header is force-included into the compile, so a definition that differs from its prototype
does not build, and the loaded :class:`Library` gives each function the header's ctypes types
and refuses a symbol the header does not declare.

A library is built for this CPU (``-march=native``) into the user's cache directory,
named by a hash of the files it is built from, the compiler, the flags and the CPU's feature
flags, so an edit, a new compiler or another machine sharing the home directory each get their
own build. Processes starting together race harmlessly: each compiles to a private file and
renames it into place. ``$ENGINE_NATIVE_CFLAGS`` adds flags to every build of a process (the
tests' sanitizer runs; ``-g -O0`` for a debugger).

Libraries are compiled with OpenMP. torch ships its own ``libgomp.so.1`` and loads it first;
the dynamic linker resolves a library's ``libgomp.so.1`` to that copy by its soname, so
kernels and torch's ops share one thread pool (no second set of spinning threads on the
same cores) and ``torch.set_num_threads`` governs both.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from engine.native.errors import BuildError
from engine.native.prototypes import HeaderError, Prototype, read_header

__all__ = [
    "CFLAGS_VARIABLE",
    "FLAGS",
    "INCLUDE_DIR",
    "PORTABLE_FLAGS",
    "BuildError",
    "HeaderError",
    "Library",
    "Prototype",
    "load_source",
]

INCLUDE_DIR = Path(__file__).with_name("include")
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c11", "-fopenmp"]
PORTABLE_FLAGS = [flag for flag in FLAGS if flag != "-march=native"]  # the compiler's baseline ISA
CFLAGS_VARIABLE = "ENGINE_NATIVE_CFLAGS"
_QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


class Library(ctypes.CDLL):
    """A built library whose functions carry their header's ctypes types (``prototypes``). A
    symbol the header does not declare is refused: ctypes would call it with guessed types."""

    def __init__(self, path: Path, header: Path, prototypes: dict[str, Prototype]):
        super().__init__(str(path))
        self.header, self.prototypes = header, prototypes

    def __getitem__(self, name: str):
        prototype = self.prototypes.get(name)
        if prototype is None:
            raise AttributeError(f"{name} is not declared in {self.header.name}")
        function = super().__getitem__(name)
        function.argtypes, function.restype = prototype.argtypes, prototype.restype
        return function


def load_source(
    source: Path, compiler_name: str | None = None, portable: bool = False, extra_flags: Sequence[str] = ()
) -> Library:
    """``source`` built (once per machine) and loaded; ``compiler_name`` defaults to ``$CC``
    or ``cc``. ``portable`` builds for the compiler's baseline instruction set instead of this
    CPU's (no AVX-512): the fallback paths a CPU without it runs, for tests. ``extra_flags`` come
    after ``$ENGINE_NATIVE_CFLAGS`` (``engine.testing.native``'s warning build). Raises
    :class:`BuildError` saying why it cannot be built (a :class:`HeaderError` for its header)."""
    import torch  # noqa: F401  -- its libgomp must be loaded before ours is resolved

    compiler_name = compiler_name or os.environ.get("CC", "cc")
    compiler = shutil.which(compiler_name)
    if compiler is None:
        raise BuildError(f"no C compiler ({compiler_name!r} is not on PATH)")
    header = source.with_suffix(".h")
    prototypes = read_header(header)
    flags = [
        *(PORTABLE_FLAGS if portable else FLAGS),
        *shlex.split(os.environ.get(CFLAGS_VARIABLE, "")),
        *extra_flags,
    ]
    target = _cache_dir() / f"{source.stem}-{_build_key(compiler, source, flags)}.so"
    if not target.exists():
        _compile(compiler, source, header, target, flags)
    library = Library(target, header, prototypes)
    undefined = [name for name in prototypes if not hasattr(library, name)]
    if undefined:
        raise BuildError(f"{header.name} declares what {source.name} does not define: {', '.join(undefined)}")
    return library


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(root) / "engine" / "cpu-native"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _build_key(compiler: str, source: Path, flags: list[str]) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256(version.encode() + " ".join(flags).encode() + _cpu_flags().encode())
    for path in _inputs(source):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def _inputs(source: Path) -> list[Path]:
    """The files a build reads: ``source``, its header and what they ``#include "..."`` from
    their own folder or :data:`INCLUDE_DIR`, transitively (an edit to any rebuilds)."""
    found, pending = set(), [source, source.with_suffix(".h")]
    while pending:
        path = pending.pop()
        if path in found or not path.exists():
            continue
        found.add(path)
        for name in _QUOTED_INCLUDE.findall(path.read_text()):
            pending.extend(folder / name for folder in (path.parent, INCLUDE_DIR))
    return sorted(found)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _compile(compiler: str, source: Path, header: Path, target: Path, flags: list[str]) -> None:
    """Built with ``header`` force-included, so the compiler checks each definition against the
    prototype Python binds, even where the source forgets to include it."""
    fd, scratch = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        command = [
            compiler,
            *flags,
            f"-I{INCLUDE_DIR}",
            "-include",
            str(header),
            str(source),
            "-o",
            scratch,
            "-lm",
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise BuildError(f"{compiler} failed: {done.stderr.strip()[:2000]}")
        os.replace(scratch, target)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
