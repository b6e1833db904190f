"""kvconnectors-offload against the core's KV connector contract: a CPU tier alone, and a CPU
tier of two blocks over a disk tier (most blocks go down to disk and come back from files)."""

from engine.testing.kv_connector import KVConnectorContract


class TestCPUTier(KVConnectorContract):
    connector_name = "offload"


class TestDiskTier(KVConnectorContract):
    connector_name = "offload"

    def extra_config(self, folder):
        block_bytes = 2 * 2 * 4 * 3 * 4  # the contract's caches: 2 layers of [2, block 4, width 3] float32
        return {"cpu_bytes": 2 * block_bytes, "disk_path": folder, "disk_bytes": 1 << 20}
