"""The KV connector contract against the test connector (tests/plugins/memory_connector.py),
synchronous and asynchronous."""

from engine.testing.kv_connector import KVConnectorContract


class TestMemoryConnector(KVConnectorContract):
    connector_name = "test-memory"


class TestAsynchronousMemoryConnector(KVConnectorContract):
    connector_name = "test-memory"

    def extra_config(self, folder):
        return {"async": True}
