"""Where NIXL's Python API comes from: the ``nixl`` meta package re-exports it as ``nixl._api``;
the ``nixl-cu12`` wheel this plugin depends on ships it as ``nixl_cu12._api`` (one wheel, UCX
bundled, no CUDA needed to move host memory)."""

from __future__ import annotations

import importlib
from types import ModuleType

MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
INSTALL_HINT = "pip install nixl-cu12 (after torch, so that no CUDA build of torch is pulled)"


def load() -> ModuleType:
    """The module holding ``nixl_agent`` and ``nixl_agent_config``; ImportError saying how to
    install NIXL when none is there."""
    problems = []
    for name in MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            problems.append(f"{name}: {exc}")
    raise ImportError(f"the nixl KV connector needs NIXL ({INSTALL_HINT}); tried " + "; ".join(problems))


def missing_reason() -> str | None:
    """Why NIXL cannot be used here, or None (tests skip with this reason)."""
    try:
        load()
    except ImportError as exc:
        return str(exc)
    return None
