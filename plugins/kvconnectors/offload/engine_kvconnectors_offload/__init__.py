"""kvconnectors-offload: full KV blocks written through to a CPU-memory tier (and a disk tier
under it) when their request finishes, keyed by block hash, and loaded back instead of being
recomputed once the device pool has evicted them."""

from engine import hookimpl


@hookimpl
def register_kv_connectors(register):
    register("offload", "engine_kvconnectors_offload.connector:OffloadConnector", api=4)
