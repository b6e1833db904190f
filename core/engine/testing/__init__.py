"""The conformance kit: contract tests a plugin package runs against itself.

Subclass a contract in your plugin's tests and name what you register::

    from engine.testing.attention import AttentionBackendContract

    class TestMyBackend(AttentionBackendContract):
        backend_name = "mykernel"

or run ``pytest --engine-conformance`` to check every installed plugin's registrations.
Contracts: ``attention.AttentionBackendContract``, ``models.ModelContract``,
``kv_cache.KVCacheManagerContract``, ``scheduler.SchedulerContract``,
``grammar.GrammarBackendContract``.
"""
