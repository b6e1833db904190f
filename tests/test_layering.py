"""Imports run downhill. The folders of ``engine`` stand on floors (:data:`FLOORS`): a module
imports only from a lower floor or its own folder, no file imports another in a loop, and the
interfaces (``engine.interfaces``) and everything they import, directly or through other modules
of the ``engine`` package, stay below the engine core, the runner, the layers, the executors and
the built-ins, and import no plugin. Read from the source with ``ast`` (every import: module
level, inside functions, under TYPE_CHECKING), so nothing has to be imported to check it."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "core" / "engine"

# what stands above the interfaces: each imports them
ABOVE = (
    "engine.core",
    "engine.runner",
    "engine.layers",
    "engine.executors",
    "engine.builtin",
    "engine.testing",
    "engine.entrypoints.llm",
    "engine.entrypoints.cli",
    "engine.client",
    "engine_server",
)

# The floors, ground first: a folder (or top-level module) of ``engine`` imports only from the
# floors below it and from itself.
FLOORS = (
    # what crosses between the layers; how OpenMP's threads wait (set before torch loads)
    ("engine.messages", "engine.hookspecs", "engine.lifetime", "engine.openmp"),
    ("engine.config", "engine.distributed"),  # the engine's configuration; tensor-parallel groups
    ("engine.interfaces",),  # the plugin contract
    ("engine.native",),  # C kernels built and bound; native tapes; the sampler's row kernels
    ("engine.layers", "engine.kv_transfer", "engine.runner"),  # what plugins build on
    ("engine.builtin", "engine.lora"),  # the core's own plugins; LoRA adapters and their slots
    ("engine.plugins",),  # discovery and the registry
    ("engine.core",),  # the engine loop and the request lifecycle
    ("engine.executors",),  # where the runner's steps run
    ("engine.client",),  # one engine client for every front end
    ("engine.entrypoints", "engine.testing", "engine"),  # front ends; the conformance kit; the facade
)

# (importing file, imported module) pairs still to be moved down, each with why it stands
KNOWN = {
    # Platform.layer_ops's default returns the plain-torch LayerOps, whose pack_dense
    # prepacks bfloat16 weights with engine.layers.dense; cpu-native's NativeLayerOps
    # inherits it. Moving it down changes the platform and layer-ops contracts: not here.
    ("interfaces/platform.py", "engine.layers.ops"),
}


def _file(module: str) -> Path | None:
    """The source of an ``engine`` module, or None for one outside the package."""
    parts = module.split(".")
    if parts[0] != "engine":
        return None
    base = ENGINE.joinpath(*parts[1:])
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _imports(source: str, package: str) -> set[str]:
    """Every module ``source`` (a module of ``package``) imports, with the packages whose
    ``__init__`` that runs, and ``from X import Y`` counted as ``X.Y`` too where Y is a
    submodule of the engine."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(filter(None, (base, node.module)))
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names if _file(f"{module}.{a.name}"))
    parents = {".".join(m.split(".")[:i]) for m in found for i in range(1, m.count(".") + 1)}
    return found | parents


def _imports_of(path: Path) -> set[str]:
    package = ".".join(("engine", *path.relative_to(ENGINE).with_suffix("").parts[:-1]))
    return _imports(path.read_text(), package)


def _is_above(module: str) -> bool:
    return module.split(".")[0].startswith("engine_") or any(
        module == above or module.startswith(above + ".") for above in ABOVE
    )


def _uphill_imports() -> set[tuple[str, str]]:
    """(file, module) for each import above the interfaces that the interfaces reach."""
    todo = sorted((ENGINE / "interfaces").glob("*.py"))
    seen, uphill = set(todo), set()
    while todo:
        path = todo.pop()
        for module in _imports_of(path):
            if _is_above(module):
                uphill.add((path.relative_to(ENGINE).as_posix(), module))
            elif (source := _file(module)) is not None and source not in seen:
                seen.add(source)
                todo.append(source)
    # one row per import statement: engine.layers.ops, not also its package engine.layers
    return {(f, m) for f, m in uphill if not any(f == g and n.startswith(m + ".") for g, n in uphill)}


def test_interfaces_import_nothing_above_them():
    uphill = _uphill_imports()
    assert uphill - KNOWN == set(), "the interfaces reach modules above them"
    assert KNOWN - uphill == set(), "moved down already: strike it from KNOWN"


def test_the_interfaces_import_nothing_by_name():
    """An import by a computed name (``importlib.import_module``, ``__import__``) hides from
    the check above, as the interfaces' former lazy import of the engine core's types did."""
    for path in (ENGINE / "interfaces").glob("*.py"):
        calls = {
            node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call)
        }
        assert not calls & {"import_module", "__import__"}, path.name


def test_the_reader_sees_every_kind_of_import():
    """The check above is only as good as the import reader: it finds module-level, nested,
    TYPE_CHECKING, relative and ``from`` imports, and the packages whose ``__init__`` they run."""
    source = """
from typing import TYPE_CHECKING
import engine.messages.request
from engine.messages import step
from . import kv_cache
from ..core.setup import build_model
if TYPE_CHECKING:
    from engine.distributed import GroupAddress
def layer_ops():
    from engine.layers.ops import LayerOps
"""
    found = _imports(source, "engine.interfaces")
    assert {
        "engine.messages.request",
        "engine.messages.step",
        "engine.interfaces.kv_cache",
        "engine.core.setup",
        "engine.distributed",
        "engine.layers.ops",
        "engine.layers",
        "engine.core",
        "engine",
    } <= found


def test_the_request_state_and_step_messages_are_public_from_the_ground_floor():
    from engine import interfaces

    for name in ("Request", "RequestStatus"):
        assert getattr(interfaces, name).__module__ == "engine.messages.request"
    for name in ("StepPlan", "ScheduledRequest", "StepResult", "EngineOutput", "TokenLogprobs", "Overloaded"):
        assert getattr(interfaces, name).__module__ == "engine.messages.step"
    assert all(hasattr(interfaces, name) for name in interfaces.__all__)


def _folder(module: str) -> str:
    """``engine.core.setup`` -> ``engine.core``; ``engine.config`` -> itself; ``engine`` -> itself."""
    return ".".join(module.split(".")[:2])


def _floor(module: str) -> int:
    folder = _folder(module)
    return next(i for i, floor in enumerate(FLOORS) if folder in floor)


def _module_of(path: Path) -> str:
    return ".".join(("engine", *path.relative_to(ENGINE).with_suffix("").parts)).removesuffix(".__init__")


def _engine_imports() -> dict[str, set[str]]:
    """Each engine module -> the engine modules it imports (the ``engine`` facade, which every
    import runs first, left out)."""
    graph = {}
    for path in sorted(ENGINE.rglob("*.py")):
        skip = (path, ENGINE / "__init__.py")
        graph[_module_of(path)] = {
            _module_of(source)
            for module in _imports_of(path)
            if (source := _file(module)) is not None and source not in skip
        }
    return graph


def test_every_folder_stands_on_a_floor():
    folders = {_folder(module) for module in _engine_imports()}
    assert folders == {folder for floor in FLOORS for folder in floor}, "a folder without a floor"


def test_no_module_imports_from_a_floor_above_its_own():
    def known(module: str, imported: str) -> bool:  # a KNOWN import, or its package's __init__
        return any(
            module == f"engine.{file.removesuffix('.py').replace('/', '.')}"
            and (target == imported or target.startswith(imported + "."))
            for file, target in KNOWN
        )

    uphill = {
        (module, imported)
        for module, imports in _engine_imports().items()
        for imported in imports
        if _folder(module) != _folder(imported)
        and _floor(imported) >= _floor(module)
        and not known(module, imported)
    }
    assert uphill == set(), "imports from the same floor or above (FLOORS)"


def test_no_file_imports_another_in_a_loop():
    graph, loops, state = _engine_imports(), [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for imported in sorted(graph.get(module, ())):
            if imported in {m for m in graph if m.startswith(module + ".")}:
                continue  # a package's __init__ running its own submodules is not a loop
            if state.get(imported) == "open":
                loops.append(path[path.index(imported) :] + [imported])
            elif imported not in state:
                visit(imported, [*path, imported])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert loops == [], "files importing each other in a loop"
