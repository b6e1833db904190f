"""kvconnectors-nixl: prefill/decode disaggregation between engine instances, the decode instance
reading a prefilled prompt's KV blocks straight out of the prefill instance's registered caches
with NIXL (``engine.kv_transfer.PDConnector`` over
:class:`~engine_kvconnectors_nixl.transport.NixlTransport`).

Registered as ``nixl`` and under vLLM's class name ``NixlConnector``, so a vLLM
``--kv-transfer-config '{"kv_connector": "NixlConnector", ...}'`` works unchanged."""

from engine import hookimpl

CONNECTOR = "engine_kvconnectors_nixl.connector:NixlConnector"


@hookimpl
def register_kv_connectors(register):
    register("nixl", CONNECTOR, api=3)
    register("NixlConnector", CONNECTOR, api=3)
