"""Plugin discovery: entry points, allow-list, interface-version checks, registries.

Loading is idempotent per process and per allow-list: the engine core, the API server
and tensor-parallel workers all call :func:`load_plugins` and share the result.

One bad plugin cannot take the others down. Each problem is one line naming the plugin,
its distribution and version, and the reason: a module that fails to import (``failed``);
a hook that raises or registers something malformed — no ``api=``, another interface
version, a bad name, a target that is not a class of its kind — (``refused``, with none of
its registrations kept); a hook implementation whose name matches no hook (reported, the
plugin's other hooks load). A registered target is imported only when selected;
:meth:`Registration.load` turns a failure there into one :class:`RegistrationError` naming
the registration, and automatic selection (``engine.core.setup``) skips it.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import logging
import re
from collections.abc import Iterable

import attrs
import pluggy

from engine import builtin, hookspecs, interfaces
from engine.interfaces import INTERFACE_VERSIONS, STILL_LOADED

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "engine.plugins"
BUILTIN = "builtin"
HOOK_NAMES = tuple(f"register_{kind}" for kind in INTERFACE_VERSIONS)

# the class every registration of a kind must subclass ("engine.cli" imports this module)
_INTERFACES = {
    "platforms": "Platform", "attention_backends": "AttentionBackend", "models": "Model",
    "model_loaders": "ModelLoader", "quant_methods": "QuantMethod", "kv_connectors": "KVConnector",
    "grammar_backends": "GrammarBackend", "drafters": "Drafter", "logits_processors": "LogitsProcessor",
    "schedulers": "Scheduler", "kv_cache_managers": "KVCacheManager", "tool_parsers": "ToolParser",
    "reasoning_parsers": "ReasoningParser",
    "commands": "engine.cli:Command", "executors": "Executor",
}
_LAZY_TARGET = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_BAD_NAME_CHARS = re.compile(r"[\s,]")


def kind_label(kind: str) -> str:
    """``"attention_backends"`` -> ``"attention backend"``."""
    return kind[:-1].replace("_", " ")


def interface_of(kind: str) -> type:
    spec = _INTERFACES[kind]
    if ":" not in spec:
        return getattr(interfaces, spec)
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


class RegistrationError(RuntimeError):
    """A registration cannot be used: its target fails to import or is not a class of its kind."""

    def __init__(self, registration: Registration, reason: str):
        super().__init__(f"{kind_label(registration.kind)} {registration.name!r} "
                         f"(plugin {registration.plugin!r}) {reason}")
        self.registration = registration
        self.reason = reason


@attrs.frozen
class Registration:
    """One thing a plugin provides: ``kind`` (a hook name without ``register_``) and ``name``."""

    kind: str
    name: str
    target: object
    plugin: str

    def load(self):
        """The registered class, importing a lazy ``"module:Attr"`` target (importlib caches
        modules). Raises :class:`RegistrationError` if the import fails or the result is not
        a subclass of the kind's interface."""
        try:
            obj = self._import()
        except Exception as exc:  # whatever the plugin's module raises while importing
            raise RegistrationError(self, f"cannot be imported: {one_line(exc)}") from exc
        wrong = wrong_target_reason(self.kind, obj)
        if wrong:
            raise RegistrationError(self, wrong)
        return obj

    def _import(self):
        if not isinstance(self.target, str):
            return self.target
        module_name, _, attr = self.target.partition(":")
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj


def wrong_target_reason(kind: str, obj) -> str | None:
    interface = interface_of(kind)
    if isinstance(obj, type) and issubclass(obj, interface):
        return None
    return f"is {obj!r}, not a subclass of {interface.__module__}.{interface.__qualname__}"


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


@attrs.frozen
class PluginInfo:
    name: str
    distribution: str
    version: str
    status: str = "loaded"  # "loaded", or "refused: <reason>" / "failed: <reason>"
    notes: tuple[str, ...] = ()  # problems that did not refuse it (a hook name that matches no hook)

    @property
    def loaded(self) -> bool:
        return self.status == "loaded"

    def describe(self) -> str:
        """``name  (distribution version)  status[; note ...]``: the plugin's one line."""
        return "; ".join([f"{self.name}  ({self.distribution} {self.version})  {self.status}", *self.notes])


class _Recorder:
    """The ``register`` callable handed to one hook call. It validates every call and keeps
    the first problem, so a plugin that catches the ValueError is still refused."""

    def __init__(self, kind: str, plugin: str):
        self.kind, self.plugin = kind, plugin
        self.registrations: list[Registration] = []
        self.problem: str | None = None

    def register(self, name, target, *, api=None):
        problem = self._problem(name, target, api)
        if problem:
            self.problem = self.problem or problem
            raise ValueError(problem)
        self.registrations.append(Registration(self.kind, name, target, self.plugin))

    def _problem(self, name, target, api) -> str | None:
        label, provided = kind_label(self.kind), INTERFACE_VERSIONS[self.kind]
        if not isinstance(name, str) or not name or _BAD_NAME_CHARS.search(name):
            return f"{label} name {name!r} is not a non-empty string without spaces or commas"
        if api is None:
            return (f"{label} {name!r} registered without api= "
                    f"(the interface version it targets; this core provides v{provided})")
        if api != provided and api not in STILL_LOADED.get(self.kind, ()):
            return f"built for {self.kind} interface v{api}, this core provides v{provided}"
        if isinstance(target, str):
            if not _LAZY_TARGET.fullmatch(target):
                return f"{label} {name!r}: target {target!r} is not \"module:Attribute\""
            return None
        wrong = wrong_target_reason(self.kind, target)
        return f"{label} {name!r}: target {wrong}" if wrong else None


class PluginRegistry:
    """What every loaded plugin registered, by kind and name."""

    def __init__(self, allow: Iterable[str] | None = None):
        self.plugins: dict[str, PluginInfo] = {}
        self._by_kind: dict[str, dict[str, Registration]] = {kind: {} for kind in INTERFACE_VERSIONS}
        self._manager = pluggy.PluginManager("engine")
        self._manager.add_hookspecs(hookspecs.EngineHookSpecs)
        self._add(BUILTIN, builtin, PluginInfo(BUILTIN, "tessellm-core", _version("tessellm-core")))
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
                self._add(name, module, PluginInfo(name, "(in-process)", "-"))
        for ep in entry_points:
            if allow is not None and ep.name not in allow:
                continue
            info = PluginInfo(ep.name, ep.dist.name if ep.dist else "?", ep.dist.version if ep.dist else "?")
            try:
                module = ep.load()
            except Exception as exc:  # noqa: BLE001 - a broken plugin must not take the others down
                self.plugins[ep.name] = attrs.evolve(info, status=f"failed: {one_line(exc)}")
                logger.warning("plugin %r (%s %s) failed to import: %s", ep.name, info.distribution,
                               info.version, one_line(exc))
                continue
            self._add(ep.name, module, info)

    def _add(self, name: str, module, info: PluginInfo) -> None:
        """Register ``module``'s hook implementations; refuse it if pluggy cannot (a hook's
        arguments that its spec does not have, a module registered twice)."""
        self.plugins[name] = info
        try:
            self._manager.register(module, name=name)
        except Exception as exc:  # noqa: BLE001 - whatever pluggy rejects refuses this plugin only
            if self._manager.get_plugin(name) is module:  # pluggy keeps what it added before failing
                self._manager.unregister(name=name)
            self._refuse(name, one_line(exc), registered=False)
            return
        notes = tuple(_hook_name_problems(self._manager, module))
        if notes:
            self.plugins[name] = attrs.evolve(info, notes=notes)
            for note in notes:
                logger.warning("plugin %r (%s %s): %s", name, info.distribution, info.version, note)

    def _collect(self) -> None:
        pending: dict[str, list[Registration]] = {name: [] for name, info in self.plugins.items() if info.loaded}
        refused: dict[str, str] = {}
        for kind in INTERFACE_VERSIONS:
            for impl in getattr(self._manager.hook, f"register_{kind}").get_hookimpls():
                plugin = impl.plugin_name
                if plugin in refused:
                    continue
                recorder = _Recorder(kind, plugin)
                try:
                    impl.function(register=recorder.register)
                except Exception as exc:  # noqa: BLE001 - the plugin's code failed, or register refused a call
                    refused[plugin] = recorder.problem or f"register_{kind} raised {one_line(exc)}"
                    continue
                if recorder.problem:
                    refused[plugin] = recorder.problem
                pending[plugin] += recorder.registrations
        for plugin, reason in refused.items():
            self._refuse(plugin, reason)
        # builtin first so that an installed plugin may replace a default of the same name
        for plugin in sorted(pending, key=lambda p: p != BUILTIN):
            if plugin not in refused:
                for registration in pending[plugin]:
                    self._by_kind[registration.kind][registration.name] = registration

    def _refuse(self, plugin: str, reason: str, registered: bool = True) -> None:
        info = self.plugins[plugin]
        self.plugins[plugin] = attrs.evolve(info, status=f"refused: {reason}")
        if registered:
            self._manager.unregister(name=plugin)
        logger.warning("plugin %r (%s %s) refused: %s", plugin, info.distribution, info.version, reason)

    def names(self, kind: str) -> list[str]:
        return list(self._by_kind[kind])

    def registrations(self, kind: str) -> list[Registration]:
        return list(self._by_kind[kind].values())

    def registered_by(self, plugin: str) -> list[Registration]:
        return [r for regs in self._by_kind.values() for r in regs.values() if r.plugin == plugin]

    def get(self, kind: str, name: str):
        """The class registered as ``name``: a ValueError listing the alternatives if there is
        none, a :class:`RegistrationError` naming it and the import error if it cannot load."""
        registration = self._by_kind[kind].get(name)
        if registration is None:
            available = ", ".join(self._by_kind[kind]) or "none installed"
            raise ValueError(f"no {kind_label(kind)} named {name!r} (available: {available})")
        return registration.load()


def _hook_name_problems(manager: pluggy.PluginManager, module) -> list[str]:
    """One note per hook implementation that no hook calls: a marked function whose name is
    no hook (a typo), or a function named like a hook but not marked ``@engine.hookimpl``."""
    notes = []
    for caller in manager.get_hookcallers(module) or []:
        if not caller.has_spec():
            close = difflib.get_close_matches(caller.name, HOOK_NAMES, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            notes.append(f"ignored hook {caller.name}: no such hook{hint}")
    implemented = {caller.name for caller in manager.get_hookcallers(module) or []}
    for name in HOOK_NAMES:
        if name not in implemented and callable(getattr(module, name, None)):
            notes.append(f"ignored {name}: not marked @engine.hookimpl")
    return notes


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
