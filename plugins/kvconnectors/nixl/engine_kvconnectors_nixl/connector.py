"""NixlConnector: vLLM's P/D flow (:class:`engine.kv_transfer.PDConnector`) over NIXL."""

from engine.kv_transfer import PDConnector
from engine_kvconnectors_nixl.transport import NixlTransport


class NixlConnector(PDConnector):
    transport_class = NixlTransport
