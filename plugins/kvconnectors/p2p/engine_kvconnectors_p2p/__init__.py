"""kvconnectors-p2p: prefill/decode disaggregation between engine instances, the KV blocks of a
prefilled prompt pulled by the decode instance over ZMQ/TCP (``engine.kv_transfer.PDConnector``
over :class:`~engine_kvconnectors_p2p.transport.ZmqTransport`)."""

from engine import hookimpl


@hookimpl
def register_kv_connectors(register):
    register("p2p", "engine_kvconnectors_p2p.connector:P2pConnector", api=3)
