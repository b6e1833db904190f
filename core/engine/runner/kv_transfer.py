"""The KV connector's worker half around one step on the device."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def connector_step(connector, kv_meta: object):
    """Bind the step's metadata and start its loads before the forward (whose layers call the
    per-layer hooks); after it, wait for the saves and clear the metadata. Without metadata (a
    step re-run to isolate a fault) nothing is bound: the hooks find nothing pending."""
    if connector is None or kv_meta is None:
        yield
        return
    connector.bind_connector_metadata(kv_meta)
    connector.start_load_kv()
    try:
        yield
    finally:
        connector.wait_for_save()
        connector.clear_connector_metadata()
