"""Compile a plugin's C source once per machine with the system C compiler and load it.

Plugins with C kernels (the cpu-native platform's ops, the cpu-native attention backend) build
them here rather than each carrying a build step. Sources may ``#include "engine_bf16.h"``
(:data:`INCLUDE_DIR`): the bfloat16 conversions every kernel needs, written once.

A library is built for this CPU (``-march=native``) into the user's cache directory,
named by a hash of the source, the compiler and the CPU's feature flags, so an edit, a new
compiler or another machine sharing the home directory each get their own build. Processes
starting together race harmlessly: each compiles to a private file and renames it into place.

Libraries are compiled with OpenMP. torch ships its own ``libgomp.so.1`` and loads it first;
the dynamic linker resolves a library's ``libgomp.so.1`` to that copy by its soname, so
kernels and torch's ops share one thread pool (no second set of spinning threads on the
same cores) and ``torch.set_num_threads`` governs both.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

INCLUDE_DIR = Path(__file__).with_name("include")
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c11", "-fopenmp"]
PORTABLE_FLAGS = [flag for flag in FLAGS if flag != "-march=native"]  # the compiler's baseline ISA


class BuildError(RuntimeError):
    pass


def load_source(source: Path, compiler_name: str | None = None, portable: bool = False) -> ctypes.CDLL:
    """``source`` built (once per machine) and loaded; ``compiler_name`` defaults to ``$CC``
    or ``cc``. ``portable`` builds for the compiler's baseline instruction set instead of this
    CPU's (no AVX-512): the fallback paths a CPU without it runs, for tests. Raises
    :class:`BuildError` saying why it cannot be built."""
    import torch  # noqa: F401  -- its libgomp must be loaded before ours is resolved

    compiler_name = compiler_name or os.environ.get("CC", "cc")
    compiler = shutil.which(compiler_name)
    if compiler is None:
        raise BuildError(f"no C compiler ({compiler_name!r} is not on PATH)")
    flags = PORTABLE_FLAGS if portable else FLAGS
    target = _cache_dir() / f"{source.stem}-{_build_key(compiler, source, flags)}.so"
    if not target.exists():
        _compile(compiler, source, target, flags)
    return ctypes.CDLL(str(target))


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(root) / "engine" / "cpu-native"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _build_key(compiler: str, source: Path, flags: list[str]) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256(source.read_bytes() + version.encode() + " ".join(flags).encode())
    for header in sorted(INCLUDE_DIR.glob("*.h")):  # an edited header rebuilds what includes it
        digest.update(header.read_bytes())
    digest.update(_cpu_flags().encode())
    return digest.hexdigest()[:16]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _compile(compiler: str, source: Path, target: Path, flags: list[str]) -> None:
    fd, scratch = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, f"-I{INCLUDE_DIR}", str(source), "-o", scratch, "-lm"],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise BuildError(f"{compiler} failed: {done.stderr.strip()[:500]}")
        os.replace(scratch, target)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
