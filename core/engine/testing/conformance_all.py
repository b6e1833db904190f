"""Collected by ``pytest --engine-conformance``: one contract class per registration (one per
distinct target where several names register the same class, e.g. a connector also registered
under vLLM's name), those another plugin's registration of the same name shadows included: they
are selected as ``"<plugin>:<name>"``, a shadowed model with the plugins that shadow it left out
of the engine's allow-list. KV connectors built on the P/D seam (``engine.kv_transfer.PDConnector``)
get the P/D contract, every other one the plain KV connector contract. An attention backend gets
the contract of each cache layout it reads: per-head K/V (``attention``), the paged latent layout
(``latent_attention``)."""

from engine.interfaces import PAGED_KV, PAGED_LATENT
from engine.kv_transfer import PDConnector
from engine.plugins import RegistrationError, load_plugins
from engine.testing.attention import AttentionBackendContract
from engine.testing.grammar import GrammarBackendContract
from engine.testing.kv_cache import KVCacheManagerContract
from engine.testing.kv_connector import KVConnectorContract
from engine.testing.latent_attention import LatentAttentionContract
from engine.testing.layer_ops import LayerOpsContract
from engine.testing.lora_resolver import LoRAResolverContract
from engine.testing.models import ModelContract
from engine.testing.pd_connector import PDConnectorContract
from engine.testing.scheduler import SchedulerContract

_registry = load_plugins()


def _name(*parts: str) -> str:
    return "Test_" + "_".join(p.replace("-", "_").replace(".", "_").replace(":", "_") for p in parts)


def kv_connector_contract(registration) -> type:
    """The P/D contract (a producer and a consumer over the real transport) for a connector built
    on the P/D seam, the plain one otherwise. One that cannot load gets the plain contract, whose
    tests fail naming why."""
    try:
        connector = registration.load()
    except RegistrationError:
        return KVConnectorContract
    return PDConnectorContract if issubclass(connector, PDConnector) else KVConnectorContract


def attention_contracts(registration) -> list[tuple[str, type]]:
    """(prefix, contract) per cache layout the backend reads. One that cannot load gets the
    per-head contract, whose tests fail naming why."""
    try:
        layouts = registration.load().cache_layouts
    except RegistrationError:
        layouts = (PAGED_KV,)
    contracts: dict[str, tuple[str, type]] = {
        PAGED_KV: ("attention", AttentionBackendContract),
        PAGED_LATENT: ("latent_attention", LatentAttentionContract),
    }
    return [contracts[layout] for layout in layouts if layout in contracts]


def selecting_name(registration) -> str:
    """The name that selects ``registration``: its own, or ``"<plugin>:<name>"`` where another
    plugin's registration of that name wins."""
    return registration.name if _registry.shadowing(registration) is None else registration.qualified_name


def allow_list_for(registrations) -> tuple[str, ...] | None:
    """The plugins to load so that the checkpoint's architecture selects these registrations' model
    class: every plugin but those whose registrations shadow them (None: all of them)."""
    winners = {w.plugin for r in registrations if (w := _registry.shadowing(r)) is not None}
    return tuple(p for p in _registry.plugins if p not in winners) if winners else None


def _contract(prefix: str, registration, base: type, attribute: str) -> None:
    name = _name(prefix, selecting_name(registration))
    globals()[name] = type(name, (base,), {attribute: selecting_name(registration)})


def _by_target(kind: str) -> dict[object, list]:
    """Target -> its registrations, every plugin's."""
    out: dict[object, list] = {}
    for r in _registry.registrations(kind, shadowed=True):
        out.setdefault(r.target, []).append(r)
    return out


for _r in _registry.registrations("attention_backends", shadowed=True):
    for _prefix, _base in attention_contracts(_r):
        _contract(_prefix, _r, _base, "backend_name")


def is_target_model(registration) -> bool:
    """False for a module only drafters build (``Model.drafter_only``), which the model contract
    cannot check; one that cannot load gets the contract, whose tests fail naming why."""
    try:
        return not registration.load().drafter_only
    except RegistrationError:
        return True


for _target, _regs in _by_target("models").items():
    if isinstance(_target, str) and is_target_model(_regs[0]):
        globals()[_name("model", _target)] = type(
            _name("model", _target),
            (ModelContract,),
            {"model_class": _target, "plugins": allow_list_for(_regs)},
        )
for _r in _registry.registrations("kv_cache_managers", shadowed=True):
    _contract("kv", _r, KVCacheManagerContract, "manager_name")
for _regs in _by_target("kv_connectors").values():  # each with its default configuration; -k: any name
    _cls = _name("kv_connector", *(selecting_name(r) for r in _regs))
    globals()[_cls] = type(
        _cls, (kv_connector_contract(_regs[0]),), {"connector_name": selecting_name(_regs[0])}
    )
for _r in _registry.registrations("grammar_backends", shadowed=True):
    _contract("grammar", _r, GrammarBackendContract, "backend_name")
for _r in _registry.registrations("schedulers", shadowed=True):
    _contract("scheduler", _r, SchedulerContract, "scheduler_name")
for _r in _registry.registrations("platforms", shadowed=True):
    _contract("layer_ops", _r, LayerOpsContract, "platform_name")
for _r in _registry.registrations("lora_resolvers", shadowed=True):
    _contract("lora_resolver", _r, LoRAResolverContract, "resolver_name")
