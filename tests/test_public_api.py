"""The server builds on the engine's public API alone: ``engine.__all__`` and the modules of
``engine.PUBLIC_MODULES``, each for the names it documents (its ``__all__`` where it has one).
Read from the source with ``ast`` (every import: module level, inside functions, under
TYPE_CHECKING, and imports by a constant name), so a deferred import cannot hide."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import engine

SERVER = Path(__file__).resolve().parents[1] / "server" / "engine_server"


def _public_names(module: str) -> set[str] | None:
    """The names ``module`` documents: its ``__all__``, or None for every name without a leading ``_``."""
    return getattr(importlib.import_module(module), "__all__", None)


def _is_public(module: str, name: str | None = None) -> bool:
    """Whether ``import module`` (``name`` None) or ``from module import name`` uses the public API."""
    if module == "engine" and name is None:
        return True
    if name is not None and f"{module}.{name}" in engine.PUBLIC_MODULES:
        return True  # a public submodule, imported from its package
    if module != "engine" and module not in engine.PUBLIC_MODULES:
        return False
    documented = engine.__all__ if module == "engine" else _public_names(module)
    return name is None or (name in documented if documented is not None else not name.startswith("_"))


def _engine_imports(source: str) -> list[tuple[str, str | None]]:
    """(module, imported name or None) for every import of the engine in ``source``."""
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Call) and _callee(node) in ("import_module", "__import__") and node.args:
            argument = node.args[0]
            found.append((argument.value if isinstance(argument, ast.Constant) else "<computed>", None))
    return [(m, n) for m, n in found if m == "<computed>" or m == "engine" or m.startswith("engine.")]


def _callee(call: ast.Call) -> str | None:
    return call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)


def test_the_server_imports_only_the_public_api():
    private = sorted(
        f"{path.relative_to(SERVER)}: {module}{'' if name is None else ' ' + name}"
        for path in SERVER.rglob("*.py")
        for module, name in _engine_imports(path.read_text())
        if not _is_public(module, name)
    )
    assert private == [], "the server imports the engine past its public API (engine.PUBLIC_MODULES)"


def test_every_public_module_and_name_exists():
    for module in engine.PUBLIC_MODULES:
        documented = _public_names(module) or ()
        assert all(hasattr(importlib.import_module(module), name) for name in documented), module
    assert all(hasattr(engine, name) for name in engine.__all__)


def test_the_reader_sees_every_kind_of_import():
    """The check is only as good as the import reader: it finds module-level, nested,
    TYPE_CHECKING and by-name imports, and judges each name against its module's ``__all__``."""
    source = """
from typing import TYPE_CHECKING
import engine.core.engine_core
from engine import LLM
from engine.messages import request_path
from engine.client import InProcessClient
if TYPE_CHECKING:
    from engine.messages.step import EngineOutput
def late():
    from engine.entrypoints.cli import Command, _runnable
    importlib.import_module("engine.runner")
"""
    imports = _engine_imports(source)
    assert set(imports) == {
        ("engine.core.engine_core", None),
        ("engine", "LLM"),
        ("engine.messages", "request_path"),
        ("engine.client", "InProcessClient"),
        ("engine.messages.step", "EngineOutput"),
        ("engine.entrypoints.cli", "Command"),
        ("engine.entrypoints.cli", "_runnable"),
        ("engine.runner", None),
    }
    assert {i for i in imports if not _is_public(*i)} == {
        ("engine.core.engine_core", None),
        ("engine.messages.step", "EngineOutput"),
        ("engine.entrypoints.cli", "_runnable"),
        ("engine.runner", None),
    }
