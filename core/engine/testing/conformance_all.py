"""Collected by ``pytest --engine-conformance``: one contract class per registration."""

from engine.plugins import load_plugins
from engine.testing.attention import AttentionBackendContract
from engine.testing.grammar import GrammarBackendContract
from engine.testing.kv_cache import KVCacheManagerContract
from engine.testing.kv_connector import KVConnectorContract
from engine.testing.layer_ops import LayerOpsContract
from engine.testing.models import ModelContract
from engine.testing.scheduler import SchedulerContract

_registry = load_plugins()


def _name(*parts: str) -> str:
    return "Test_" + "_".join(p.replace("-", "_").replace(".", "_").replace(":", "_") for p in parts)


for _r in _registry.registrations("attention_backends"):
    globals()[_name("attention", _r.name)] = type(_name("attention", _r.name), (AttentionBackendContract,),
                                                  {"backend_name": _r.name})
for _target in {r.target for r in _registry.registrations("models") if isinstance(r.target, str)}:
    globals()[_name("model", _target)] = type(_name("model", _target), (ModelContract,), {"model_class": _target})
for _r in _registry.registrations("kv_cache_managers"):
    globals()[_name("kv", _r.name)] = type(_name("kv", _r.name), (KVCacheManagerContract,),
                                           {"manager_name": _r.name})
for _r in _registry.registrations("kv_connectors"):  # each with its default configuration
    globals()[_name("kv_connector", _r.name)] = type(_name("kv_connector", _r.name), (KVConnectorContract,),
                                                     {"connector_name": _r.name})
for _r in _registry.registrations("grammar_backends"):
    globals()[_name("grammar", _r.name)] = type(_name("grammar", _r.name), (GrammarBackendContract,),
                                                {"backend_name": _r.name})
for _r in _registry.registrations("schedulers"):
    globals()[_name("scheduler", _r.name)] = type(_name("scheduler", _r.name), (SchedulerContract,),
                                                  {"scheduler_name": _r.name})
for _r in _registry.registrations("platforms"):
    globals()[_name("layer_ops", _r.name)] = type(_name("layer_ops", _r.name), (LayerOpsContract,),
                                                  {"platform_name": _r.name})
