"""Plugin discovery: entry points, allow-list, interface-version checks, registries.

Loading is idempotent per process and per allow-list: the engine core, the API server
and tensor-parallel workers all call :func:`load_plugins` and share the result.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Iterable

import attrs
import pluggy

from engine import builtin, hookspecs
from engine.interfaces import INTERFACE_VERSIONS

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "engine.plugins"
BUILTIN = "builtin"


@attrs.frozen
class Registration:
    """One thing a plugin provides: ``kind`` (a hook name without ``register_``) and ``name``."""

    kind: str
    name: str
    target: object
    plugin: str

    def load(self):
        """Import a lazy ``"module:Attr"`` target (once; importlib caches modules)."""
        if not isinstance(self.target, str):
            return self.target
        module_name, _, attr = self.target.partition(":")
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj


@attrs.frozen
class PluginInfo:
    name: str
    distribution: str
    version: str
    status: str = "loaded"  # "loaded", or "refused: <reason>" / "failed: <reason>"

    @property
    def loaded(self) -> bool:
        return self.status == "loaded"


class PluginRegistry:
    """What every loaded plugin registered, by kind and name."""

    def __init__(self, allow: Iterable[str] | None = None):
        self.plugins: dict[str, PluginInfo] = {}
        self._by_kind: dict[str, dict[str, Registration]] = {kind: {} for kind in INTERFACE_VERSIONS}
        self._manager = pluggy.PluginManager("engine")
        self._manager.add_hookspecs(hookspecs.EngineHookSpecs)
        self._manager.register(builtin, name=BUILTIN)
        self.plugins[BUILTIN] = PluginInfo(BUILTIN, "tessellm-core", _version("tessellm-core"))
        self._discover(None if allow is None else set(allow))
        self._collect()

    def _discover(self, allow: set[str] | None) -> None:
        entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        if allow is not None:
            unknown = allow - {ep.name for ep in entry_points} - set(_local)
            if unknown:
                available = ", ".join(sorted({ep.name for ep in entry_points} | set(_local))) or "none"
                raise ValueError(f"unknown plugin(s) {sorted(unknown)}; installed: {available}")
        for name, module in _local.items():
            if allow is None or name in allow:
                self._manager.register(module, name=name)
                self.plugins[name] = PluginInfo(name, "(in-process)", "-")
        for ep in entry_points:
            if allow is not None and ep.name not in allow:
                continue
            dist = ep.dist.name if ep.dist else "?"
            version = ep.dist.version if ep.dist else "?"
            try:
                module = ep.load()
            except Exception as exc:  # a broken plugin must not take the others down
                self.plugins[ep.name] = PluginInfo(ep.name, dist, version, f"failed: {exc!r}")
                logger.warning("plugin %r (%s %s) failed to import: %r", ep.name, dist, version, exc)
                continue
            self._manager.register(module, name=ep.name)
            self.plugins[ep.name] = PluginInfo(ep.name, dist, version)

    def _collect(self) -> None:
        pending: dict[str, list[tuple[Registration, int]]] = {name: [] for name in self.plugins}
        for kind in INTERFACE_VERSIONS:
            for impl in getattr(self._manager.hook, f"register_{kind}").get_hookimpls():

                def register(name, target, *, api, _kind=kind, _plugin=impl.plugin_name):
                    pending[_plugin].append((Registration(_kind, name, target, _plugin), api))

                impl.function(register=register)
        # builtin first so that an installed plugin may replace a default of the same name
        for plugin in sorted(pending, key=lambda p: p != BUILTIN):
            mismatch = next(((r, api) for r, api in pending[plugin] if api != INTERFACE_VERSIONS[r.kind]), None)
            if mismatch:
                self._refuse(plugin, *mismatch)
                continue
            for registration, _ in pending[plugin]:
                self._by_kind[registration.kind][registration.name] = registration

    def _refuse(self, plugin: str, registration: Registration, api: int) -> None:
        info = self.plugins[plugin]
        reason = (f"built for {registration.kind} interface v{api}, "
                  f"this core provides v{INTERFACE_VERSIONS[registration.kind]}")
        self.plugins[plugin] = attrs.evolve(info, status=f"refused: {reason}")
        self._manager.unregister(name=plugin)
        logger.warning("plugin %r (%s %s) refused: %s", plugin, info.distribution, info.version, reason)

    def names(self, kind: str) -> list[str]:
        return list(self._by_kind[kind])

    def registrations(self, kind: str) -> list[Registration]:
        return list(self._by_kind[kind].values())

    def registered_by(self, plugin: str) -> list[Registration]:
        return [r for regs in self._by_kind.values() for r in regs.values() if r.plugin == plugin]

    def get(self, kind: str, name: str):
        """The class registered as ``name``; a clear error listing the alternatives if none."""
        registration = self._by_kind[kind].get(name)
        if registration is None:
            available = ", ".join(self._by_kind[kind]) or "none installed"
            raise ValueError(f"no {kind[:-1].replace('_', ' ')} named {name!r} (available: {available})")
        return registration.load()


_loaded: dict[frozenset[str] | None, PluginRegistry] = {}
_local: dict[str, object] = {}


def add_plugin(module, name: str) -> None:
    """Register an in-process plugin (a module or object with hook implementations) for
    this process, as ``pytest -p`` does: for tests and embedding, without packaging.
    It is loaded like an installed one (allow-list, version checks) from the next
    :func:`load_plugins` on."""
    _local[name] = module
    _loaded.clear()


def load_plugins(allow: Iterable[str] | None = None) -> PluginRegistry:
    """Discover and load plugins once per process for a given allow-list (None: all installed)."""
    key = None if allow is None else frozenset(allow)
    if key not in _loaded:
        _loaded[key] = PluginRegistry(key)
    return _loaded[key]


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "?"
