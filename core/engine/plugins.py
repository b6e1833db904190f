"""Plugin discovery: entry points, allow-list, interface-version checks, registries.

Loading is idempotent per process and per allow-list: the engine core, the API server
and tensor-parallel workers all call :func:`load_plugins` and share the result.

One bad plugin cannot take the others down. Each problem is one line naming the plugin,
its distribution and version, and the reason: a module that fails to import (``failed``);
a hook that raises or registers something malformed — no ``api=``, another interface
version, a bad name, a target that is not a class of its kind — (``refused``, with none of
its registrations kept); a second distribution whose entry point has a name already taken
(``refused`` before its module is imported); a hook implementation whose name matches no
hook (reported, the plugin's other hooks load). A registration for a deprecated interface
version (``engine.interfaces.DEPRECATED``) loads, with one warning naming the release that
stops loading it. A registered target is imported only when selected; :meth:`Registration.load`
turns a failure there into one :class:`RegistrationError` naming the registration, and
automatic selection (``engine.core.setup``) skips it.

Everything is ordered so that nothing depends on install order: entry points by name (a name
two distributions use is kept by the one whose folder comes first on ``sys.path``, as imports
resolve, then by distribution name), plugins ``builtin`` first and then by entry-point name.
Two registrations of one kind and name (two plugins claiming one
architecture or one backend name) are both kept: the one of higher ``priority=`` wins, on a
tie an installed plugin over a built-in, then the plugin whose entry-point name sorts first.
The other stays addressable as ``"<plugin>:<name>"``. Each such collision is one warning
naming both.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import logging
import os
import re
import sys
from collections.abc import Iterable

import attrs
import pluggy

from engine import builtin, hookspecs, interfaces
from engine.interfaces import DEPRECATED, INTERFACE_VERSIONS, STILL_LOADED

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "engine.plugins"
BUILTIN = "builtin"
CORE_DISTRIBUTION = "tessellm-core"
HOOK_NAMES = tuple(f"register_{kind}" for kind in INTERFACE_VERSIONS)

# the class every registration of a kind must subclass ("engine.entrypoints.cli" imports this module)
_INTERFACES = {
    "platforms": "Platform",
    "attention_backends": "AttentionBackend",
    "models": "Model",
    "model_loaders": "ModelLoader",
    "quant_methods": "QuantMethod",
    "kv_connectors": "KVConnector",
    "grammar_backends": "GrammarBackend",
    "drafters": "Drafter",
    "logits_processors": "LogitsProcessor",
    "schedulers": "Scheduler",
    "kv_cache_managers": "KVCacheManager",
    "tool_parsers": "ToolParser",
    "reasoning_parsers": "ReasoningParser",
    "commands": "engine.entrypoints.cli:Command",
    "executors": "Executor",
    "lora_resolvers": "LoRAResolver",
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


def loaded_versions(kind: str) -> tuple[int, ...]:
    """The interface versions of ``kind`` this core loads, oldest first."""
    return tuple(sorted({*STILL_LOADED.get(kind, ()), INTERFACE_VERSIONS[kind]}))


def deprecation_warning(registration: Registration, origin: str) -> str:
    """The one line logged for a registration of a deprecated interface version: who, what, the
    release that stops loading it, and where to read how to port."""
    return (
        f"plugin {registration.plugin!r} ({origin}): {kind_label(registration.kind)} {registration.name!r} "
        f"is built for {registration.kind} interface v{registration.api}, deprecated: "
        f"{registration.dropped_in} stops loading it (this core provides "
        f'v{INTERFACE_VERSIONS[registration.kind]}; how to port: "Interface versions" in the plugin '
        "authors' guide)"
    )


class RegistrationError(RuntimeError):
    """A registration cannot be used: its target fails to import or is not a class of its kind."""

    def __init__(self, registration: Registration, reason: str):
        super().__init__(
            f"{kind_label(registration.kind)} {registration.name!r} (plugin {registration.plugin!r}) {reason}"
        )
        self.registration = registration
        self.reason = reason


@attrs.frozen
class Registration:
    """One thing a plugin provides: ``kind`` (a hook name without ``register_``) and ``name``,
    for interface version ``api`` (default: the core's); ``priority`` ranks it against another
    plugin's registration of the same kind and name, and for a kind's default
    (:meth:`PluginRegistry.default`)."""

    kind: str
    name: str
    target: object
    plugin: str
    api: int = attrs.field(default=attrs.Factory(lambda self: INTERFACE_VERSIONS[self.kind], takes_self=True))
    priority: int = 0

    @property
    def qualified_name(self) -> str:
        """``"<plugin>:<name>"``: this registration even where another of its name wins."""
        return f"{self.plugin}:{self.name}"

    @property
    def dropped_in(self) -> str | None:
        """The release that stops loading this registration's interface version, where it is in
        its release of deprecation warnings (``engine.interfaces.DEPRECATED``); else None."""
        return DEPRECATED.get(self.kind, {}).get(self.api)

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

    @property
    def origin(self) -> str:
        return f"{self.distribution} {self.version}"

    def describe(self) -> str:
        """``name  (distribution version)  status[; note ...]``: the plugin's one line."""
        return "; ".join([f"{self.name}  ({self.origin})  {self.status}", *self.notes])


class _Recorder:
    """The ``register`` callable handed to one hook call. It validates every call and keeps
    the first problem, so a plugin that catches the ValueError is still refused. ``attempted``:
    every name it was called with, so that naming one of a refused plugin says why."""

    def __init__(self, kind: str, plugin: str):
        self.kind, self.plugin = kind, plugin
        self.registrations: list[Registration] = []
        self.attempted: list[str] = []
        self.problem: str | None = None

    def register(self, name, target, *, api=None, priority=0):
        if isinstance(name, str):
            self.attempted.append(name)
        problem = self._problem(name, target, api, priority)
        if problem:
            self.problem = self.problem or problem
            raise ValueError(problem)
        self.registrations.append(Registration(self.kind, name, target, self.plugin, api, priority))

    def _problem(self, name, target, api, priority) -> str | None:
        label, provided = kind_label(self.kind), INTERFACE_VERSIONS[self.kind]
        if not isinstance(name, str) or not name or _BAD_NAME_CHARS.search(name):
            return f"{label} name {name!r} is not a non-empty string without spaces or commas"
        if api is None:
            return (
                f"{label} {name!r} registered without api= "
                f"(the interface version it targets; this core provides v{provided})"
            )
        if api not in loaded_versions(self.kind):
            loads = ", ".join(f"v{v}" for v in loaded_versions(self.kind))
            return (
                f"built for {self.kind} interface v{api}, this core provides v{provided} "
                f'(it loads {loads}; what changed: "Interface versions" in the plugin authors\' guide)'
            )
        if not isinstance(priority, int) or isinstance(priority, bool):
            return f"{label} {name!r}: priority {priority!r} is not an integer"
        if isinstance(target, str):
            if not _LAZY_TARGET.fullmatch(target):
                return f'{label} {name!r}: target {target!r} is not "module:Attribute"'
            return None
        wrong = wrong_target_reason(self.kind, target)
        return f"{label} {name!r}: target {wrong}" if wrong else None


def _precedence(registration: Registration) -> tuple:
    """Sort key of registrations sharing a kind and name: the first wins."""
    return -registration.priority, registration.plugin == BUILTIN, registration.plugin


def _why_wins(winner: Registration, loser: Registration) -> str:
    if winner.priority != loser.priority:
        return f"priority {winner.priority} > {loser.priority}"
    if loser.plugin == BUILTIN:
        return "an installed plugin replaces a built-in of the same name"
    return (
        f"equal priority {winner.priority}, and plugin names in order: {winner.plugin!r} < {loser.plugin!r}"
    )


class PluginRegistry:
    """What every loaded plugin registered, by kind and name.

    This object is also what the engine hands a plugin that builds another plugin's part (an
    attention backend delegating some batches): ``names``, ``registration``, ``get`` and
    ``default`` are public."""

    def __init__(self, allow: Iterable[str] | None = None):
        self.plugins: dict[str, PluginInfo] = {}
        # entry points refused because another distribution's took their name first
        self.duplicates: list[PluginInfo] = []
        self._by_kind: dict[str, dict[str, Registration]] = {kind: {} for kind in INTERFACE_VERSIONS}
        self._shadowed: dict[str, dict[str, list[Registration]]] = {kind: {} for kind in INTERFACE_VERSIONS}
        self._refused_names: dict[str, dict[str, str]] = {kind: {} for kind in INTERFACE_VERSIONS}
        self._manager = pluggy.PluginManager("engine")
        self._manager.add_hookspecs(hookspecs.EngineHookSpecs)
        self._add(BUILTIN, builtin, PluginInfo(BUILTIN, CORE_DISTRIBUTION, _version(CORE_DISTRIBUTION)))
        self._discover(None if allow is None else set(allow))
        self._collect()

    def _discover(self, allow: set[str] | None) -> None:
        path = [os.path.realpath(entry or os.curdir) for entry in sys.path]
        entry_points = sorted(
            importlib.metadata.entry_points(group=ENTRY_POINT_GROUP),
            key=lambda ep: (ep.name, _path_rank(ep, path), _distribution(ep)),
        )
        if allow is not None:
            unknown = allow - {ep.name for ep in entry_points} - set(_local)
            if unknown:
                available = ", ".join(sorted({ep.name for ep in entry_points} | set(_local))) or "none"
                raise ValueError(f"unknown plugin(s) {sorted(unknown)}; installed: {available}")
        for name, module in sorted(_local.items(), key=lambda item: item[0]):
            if allow is None or name in allow:
                self._add(name, module, PluginInfo(name, "(in-process)", "-"))
        for ep in entry_points:
            if allow is None or ep.name in allow:
                self._load_entry_point(ep)

    def _load_entry_point(self, ep) -> None:
        info = PluginInfo(ep.name, _distribution(ep), ep.dist.version if ep.dist else "?")
        holder = self.plugins.get(ep.name)
        if holder is not None:
            self._refuse_duplicate(info, holder)
            return
        try:
            module = ep.load()
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not take the others down
            self.plugins[ep.name] = attrs.evolve(info, status=f"failed: {one_line(exc)}")
            logger.warning("plugin %r (%s) failed to import: %s", ep.name, info.origin, one_line(exc))
            return
        self._add(ep.name, module, info)

    def _refuse_duplicate(self, info: PluginInfo, holder: PluginInfo) -> None:
        reason = (
            f"entry-point name {info.name!r} is taken by {holder.origin} (the first on sys.path, "
            "then by distribution name; give the entry point a name of your own)"
        )
        self.duplicates.append(attrs.evolve(info, status=f"refused: {reason}"))
        logger.warning("plugin %r (%s) refused: %s", info.name, info.origin, reason)

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
                logger.warning("plugin %r (%s): %s", name, info.origin, note)

    def _collect(self) -> None:
        pending: dict[str, list[Registration]] = {n: [] for n, info in self.plugins.items() if info.loaded}
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
                if recorder.problem:
                    refused[plugin] = recorder.problem
                pending[plugin] += recorder.registrations
                for name in recorder.attempted:
                    self._refused_names[kind].setdefault(name, plugin)
        for plugin, reason in refused.items():
            self._refuse(plugin, reason)
        for kind in INTERFACE_VERSIONS:  # a name stays in _refused_names only where no loaded plugin has it
            self._refused_names[kind] = {n: p for n, p in self._refused_names[kind].items() if p in refused}
        ordered = sorted((p for p in pending if p not in refused), key=lambda p: (p != BUILTIN, p))
        kept = [r for plugin in ordered for r in pending[plugin]]
        self._rank(kept)
        self._warn_deprecated(kept)

    def _warn_deprecated(self, registrations: list[Registration]) -> None:
        """One warning per registration of a deprecated interface version, so that its author
        hears of the drop a release before it happens; refused plugins' registrations never get here."""
        for registration in registrations:
            if registration.dropped_in is not None:
                logger.warning("%s", deprecation_warning(registration, self._origin(registration.plugin)))

    def _rank(self, registrations: list[Registration]) -> None:
        """Keep, per kind and name, the winner (:func:`_precedence`) and the others shadowed, in
        the order names first appear (builtin first, then plugins by name)."""
        groups: dict[tuple[str, str], list[Registration]] = {}
        for registration in registrations:
            groups.setdefault((registration.kind, registration.name), []).append(registration)
        for (kind, name), group in groups.items():
            winner, *others = sorted(group, key=_precedence)
            self._by_kind[kind][name] = winner
            self._refused_names[kind].pop(name, None)
            if others:
                self._shadowed[kind][name] = others
                for loser in others:
                    logger.warning(
                        "%s %r: plugin %r (%s) wins over plugin %r (%s): %s; the other is still "
                        "selectable as %r",
                        kind_label(kind),
                        name,
                        winner.plugin,
                        self._origin(winner.plugin),
                        loser.plugin,
                        self._origin(loser.plugin),
                        _why_wins(winner, loser),
                        loser.qualified_name,
                    )

    def _origin(self, plugin: str) -> str:
        return self.plugins[plugin].origin

    def _refuse(self, plugin: str, reason: str, registered: bool = True) -> None:
        info = self.plugins[plugin]
        self.plugins[plugin] = attrs.evolve(info, status=f"refused: {reason}")
        if registered:
            self._manager.unregister(name=plugin)
        logger.warning("plugin %r (%s) refused: %s", plugin, info.origin, reason)

    def names(self, kind: str) -> list[str]:
        """The names registered for ``kind``: the built-in ones first, then by plugin name."""
        return list(self._by_kind[kind])

    def registrations(self, kind: str, shadowed: bool = False) -> list[Registration]:
        """The registration each name selects; with ``shadowed``, every registration, those a
        name does not select after the one it does."""
        if not shadowed:
            return list(self._by_kind[kind].values())
        return [
            r
            for name, winner in self._by_kind[kind].items()
            for r in [winner, *self._shadowed[kind].get(name, [])]
        ]

    def registered_by(self, plugin: str) -> list[Registration]:
        return [
            r
            for kind in INTERFACE_VERSIONS
            for r in self.registrations(kind, shadowed=True)
            if r.plugin == plugin
        ]

    def shadowing(self, registration: Registration) -> Registration | None:
        """The registration that wins ``registration``'s name, None where it wins itself."""
        winner = self._by_kind[registration.kind][registration.name]
        return None if winner == registration else winner

    def shadowed(self, registration: Registration) -> list[Registration]:
        """The registrations of ``registration``'s name it wins over."""
        if self.shadowing(registration) is not None:
            return []
        return self._shadowed[registration.kind].get(registration.name, [])

    def precedence(self, registration: Registration) -> str | None:
        """Why ``registration`` wins or loses its name, for ``engine plugins``; None: nobody else has it."""
        winner = self.shadowing(registration)
        if winner is not None:
            return (
                f"shadowed by plugin {winner.plugin!r} ({_why_wins(winner, registration)}); "
                f"select it as {registration.qualified_name!r}"
            )
        losers = self.shadowed(registration)
        if not losers:
            return None
        return "wins over " + ", ".join(f"plugin {r.plugin!r} ({_why_wins(registration, r)})" for r in losers)

    def registration(self, kind: str, name: str) -> Registration:
        """The registration ``name`` selects: a registered name, or ``"<plugin>:<name>"`` for one
        plugin's registration (also one another plugin's of that name wins over). A ValueError
        says why there is none: a plugin that registered the name was refused (and why), or the
        name is not registered (the alternatives, and plugins that failed to import)."""
        registration = self._by_kind[kind].get(name) or self._qualified(kind, name)
        if registration is not None:
            return registration
        refusal = self.refusal(kind, name)
        if refusal is not None:
            raise ValueError(refusal)
        available = ", ".join(self._by_kind[kind]) or "none installed"
        failed = [f"{p} ({i.status})" for p, i in self.plugins.items() if i.status.startswith("failed")]
        hint = f"; plugins that failed to import: {', '.join(failed)}" if failed else ""
        raise ValueError(f"no {kind_label(kind)} named {name!r} (available: {available}){hint}")

    def refusal(self, kind: str, name: str) -> str | None:
        """Why ``name`` cannot be used when a plugin that registers it was refused (the plugin,
        its distribution and version, the reason); None when no refused plugin registers it."""
        plugin = self._refused_names[kind].get(name)
        if plugin is None:
            return None
        info = self.plugins[plugin]
        return (
            f"{kind_label(kind)} {name!r} cannot be used: plugin {plugin!r} ({info.origin}) was {info.status}"
        )

    def _qualified(self, kind: str, name: str) -> Registration | None:
        plugin, sep, short = name.partition(":")
        if not sep:
            return None
        return next(
            (r for r in self.registrations(kind, shadowed=True) if r.plugin == plugin and r.name == short),
            None,
        )

    def get(self, kind: str, name: str):
        """The class registered as ``name`` (see :meth:`registration`): a ValueError saying why
        there is none, a :class:`RegistrationError` naming it and the import error if it cannot load."""
        return self.registration(kind, name).load()

    def default(self, kind: str) -> str | None:
        """The name a kind selects when the user names none (the grammar backend): the
        registration of highest ``priority``, on a tie the first of :meth:`names` (built-ins,
        then plugins by entry-point name); None when nothing is registered."""
        preferred = self.by_preference(kind)
        return preferred[0] if preferred else None

    def by_preference(self, kind: str) -> list[str]:
        """The names of ``kind`` by ``priority``, highest first, ties in :meth:`names`' order:
        :meth:`default` is the first, and ``auto`` grammar backends are tried in this order."""
        return [r.name for r in sorted(self.registrations(kind), key=lambda r: -r.priority)]


def _distribution(ep) -> str:
    return ep.dist.name if ep.dist else "?"


def _path_rank(ep, path: list[str]) -> int:
    """The position on ``sys.path`` (``path``, resolved) of the folder holding the entry point's
    distribution, as imports resolve a module name; after every entry when it is none of them."""
    location = os.path.realpath(str(ep.dist.locate_file(""))) if ep.dist else ""
    return path.index(location) if location in path else len(path)


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
    It is loaded like an installed one (allow-list, version checks, precedence) from the
    next :func:`load_plugins` on; its name is taken before any entry point's."""
    _local[name] = module
    _loaded.clear()


def remove_plugin(name: str) -> None:
    """Forget an in-process plugin :func:`add_plugin` registered (a test's, once it is done)."""
    _local.pop(name, None)
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
