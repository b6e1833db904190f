"""A kernel library's C prototypes, read from its header: the one list of its signatures.

A library ``name.c`` declares each function Python calls in ``name.h`` beside it.
:func:`engine.native.load_source` compiles the source with that header force-included, so the
compiler rejects a definition that differs from its prototype (and, in the tests' warning
build, a function exported without one), then gives each function the ctypes types read here:
the Python side keeps no argument list of its own to drift from the C one.

The header is strictly formatted so that this small reader reads it exactly: comments and
preprocessor lines aside, it is prototypes only, each ``<result> <name>(<parameters>);`` with

- result ``void``, ``int64_t`` (a value Python acts on) or ``engine_status`` (from
  ``engine_native.h``: 0 done, non-zero the kernel refused its input);
- parameters ``void`` or ``int64_t``, ``float`` and pointers (to anything; ``const`` and
  parameter names as C allows) — the argument classes a native tape passes.

Anything else is a :class:`HeaderError` naming the statement.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from pathlib import Path

from engine.native.errors import BuildError

_RESULTS = {
    "void": (None, False),
    "int64_t": (ctypes.c_int64, False),  # (restype, whether a status)
    "engine_status": (ctypes.c_int64, True),
}
_VALUES = {"int64_t": ctypes.c_int64, "float": ctypes.c_float}
_COMMENTS = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)
_PROTOTYPE = re.compile(r"(?P<result>\w+)\s+(?P<name>\w+)\s*\((?P<parameters>[^()]*)\)")


class HeaderError(BuildError):
    """A prototype header this reader does not take (it says which statement and why)."""


@dataclass(frozen=True)
class Prototype:
    """One function's ctypes signature. ``status``: its result is an ``engine_status``."""

    name: str
    argtypes: tuple
    restype: type | None
    status: bool


def read_header(path: Path) -> dict[str, Prototype]:
    """Every prototype of the header at ``path``, by function name."""
    text = "\n".join(
        line
        for line in _COMMENTS.sub(" ", path.read_text()).splitlines()
        if not line.lstrip().startswith("#")
    )
    statements = [" ".join(s.split()) for s in text.split(";")]
    if statements[-1]:
        raise HeaderError(f"{path.name}: {statements[-1]!r} does not end with ';'")
    prototypes = [_prototype(path, statement) for statement in statements[:-1]]
    return {p.name: p for p in prototypes}


def _prototype(path: Path, statement: str) -> Prototype:
    match = _PROTOTYPE.fullmatch(statement)
    if match is None:
        raise HeaderError(f"{path.name}: {statement!r} is not a prototype '<result> <name>(<parameters>)'")
    if match["result"] not in _RESULTS:
        raise HeaderError(
            f"{path.name}: {match['name']} returns {match['result']}, not one of {', '.join(_RESULTS)}"
        )
    parameters = [p.strip() for p in match["parameters"].split(",")]
    argtypes = () if parameters == ["void"] else tuple(_argtype(path, match["name"], p) for p in parameters)
    return Prototype(match["name"], argtypes, *_RESULTS[match["result"]])


def _argtype(path: Path, name: str, parameter: str):
    if "*" in parameter:
        return ctypes.c_void_p
    words = [w for w in parameter.split() if w != "const"]
    if not 1 <= len(words) <= 2 or words[0] not in _VALUES:
        raise HeaderError(
            f"{path.name}: {name}'s parameter {parameter!r} is not an int64_t, a float or a pointer"
        )
    return _VALUES[words[0]]
