"""Collected by ``pytest --engine-conformance``: one contract class per registration (one per
distinct target where several names register the same class, e.g. a connector also registered
under vLLM's name). KV connectors built on the P/D seam (``engine.kv_transfer.PDConnector``) get
the P/D contract, every other one the plain KV connector contract."""

from engine.kv_transfer import PDConnector
from engine.plugins import RegistrationError, load_plugins
from engine.testing.attention import AttentionBackendContract
from engine.testing.grammar import GrammarBackendContract
from engine.testing.kv_cache import KVCacheManagerContract
from engine.testing.kv_connector import KVConnectorContract
from engine.testing.layer_ops import LayerOpsContract
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


for _r in _registry.registrations("attention_backends"):
    globals()[_name("attention", _r.name)] = type(_name("attention", _r.name), (AttentionBackendContract,),
                                                  {"backend_name": _r.name})
for _target in {r.target for r in _registry.registrations("models") if isinstance(r.target, str)}:
    globals()[_name("model", _target)] = type(_name("model", _target), (ModelContract,), {"model_class": _target})
for _r in _registry.registrations("kv_cache_managers"):
    globals()[_name("kv", _r.name)] = type(_name("kv", _r.name), (KVCacheManagerContract,),
                                           {"manager_name": _r.name})
_connectors: dict[object, list] = {}  # target -> its registrations
for _r in _registry.registrations("kv_connectors"):
    _connectors.setdefault(_r.target, []).append(_r)
for _regs in _connectors.values():  # each with its default configuration; -k selects by any of its names
    _cls = _name("kv_connector", *(r.name for r in _regs))
    globals()[_cls] = type(_cls, (kv_connector_contract(_regs[0]),), {"connector_name": _regs[0].name})
for _r in _registry.registrations("grammar_backends"):
    globals()[_name("grammar", _r.name)] = type(_name("grammar", _r.name), (GrammarBackendContract,),
                                                {"backend_name": _r.name})
for _r in _registry.registrations("schedulers"):
    globals()[_name("scheduler", _r.name)] = type(_name("scheduler", _r.name), (SchedulerContract,),
                                                  {"scheduler_name": _r.name})
for _r in _registry.registrations("platforms"):
    globals()[_name("layer_ops", _r.name)] = type(_name("layer_ops", _r.name), (LayerOpsContract,),
                                                  {"platform_name": _r.name})
