"""The conformance kit: contract tests a plugin package runs against itself.

Subclass a contract in your plugin's tests and name what you register::

    from engine.testing.attention import AttentionBackendContract

    class TestMyBackend(AttentionBackendContract):
        backend_name = "mykernel"

or run ``pytest --engine-conformance`` to check every installed plugin's registrations of the
kinds it covers (attention backends, models, KV cache managers, KV connectors, grammar backends,
schedulers, platforms' layer ops, LoRA resolvers). Contracts: ``attention.AttentionBackendContract``,
``models.ModelContract``, ``models.EmbeddingModelContract``, ``kv_cache.KVCacheManagerContract``,
``kv_connector.KVConnectorContract``, ``pd_connector.PDConnectorContract`` (connectors built on
``engine.kv_transfer.PDConnector``), ``scheduler.SchedulerContract``,
``grammar.GrammarBackendContract``, ``layer_ops.LayerOpsContract``,
``lora_resolver.LoRAResolverContract``, and, subclassed in the
plugin's own tests since their settings are its own, ``quant.QuantMethodContract``,
``spec.DrafterContract`` and ``multimodal.MultiModalContract`` (a model that reads images).
"""


def select_platform(name: str | None = None):
    """The platform the engine picks with every installed plugin loaded (``name``: that one),
    for a plugin's tests that build its part by hand (a quant method's ``QuantContext``)."""
    from engine.core import setup
    from engine.plugins import load_plugins

    return setup.select_platform(load_plugins(None), name)
