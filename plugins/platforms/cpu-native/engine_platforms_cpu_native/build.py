"""Compile ``kernels.c`` once per machine with the system C compiler and load it.

The library is built for this CPU (``-march=native``) into the user's cache directory,
named by a hash of the source, the compiler and the CPU's feature flags, so an edit, a new
compiler or another machine sharing the home directory each get their own build. Processes
starting together race harmlessly: each compiles to a private file and renames it into place.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c11"]


class BuildError(RuntimeError):
    pass


@functools.cache
def library() -> ctypes.CDLL:
    """The kernels, built with ``$CC`` (default ``cc``) once per machine and loaded once
    per process; raises :class:`BuildError` saying why they cannot be built."""
    return load(os.environ.get("CC", "cc"))


def load(compiler_name: str) -> ctypes.CDLL:
    compiler = shutil.which(compiler_name)
    if compiler is None:
        raise BuildError(f"no C compiler ({compiler_name!r} is not on PATH)")
    target = _cache_dir() / f"kernels-{_build_key(compiler)}.so"
    if not target.exists():
        _compile(compiler, target)
    return ctypes.CDLL(str(target))


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(root) / "engine" / "cpu-native"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _build_key(compiler: str) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256(SOURCE.read_bytes() + version.encode() + " ".join(FLAGS).encode())
    digest.update(_cpu_flags().encode())
    return digest.hexdigest()[:16]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _compile(compiler: str, target: Path) -> None:
    fd, scratch = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", scratch, "-lm"],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise BuildError(f"{compiler} failed: {done.stderr.strip()[:500]}")
        os.replace(scratch, target)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
