"""P2pConnector: vLLM's P/D flow (:class:`engine.kv_transfer.PDConnector`) over ZMQ/TCP."""

from engine.kv_transfer import PDConnector
from engine_kvconnectors_p2p.transport import ZmqTransport


class P2pConnector(PDConnector):
    transport_class = ZmqTransport
