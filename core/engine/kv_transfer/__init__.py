"""Prefill/decode disaggregation shared by every P/D connector plugin: the request bookkeeping of
both connector halves, the delayed free with its timeout, the ``kv_transfer_params`` exchange
and the failure handling (:class:`PDConnector`), over a narrow :class:`Transport` seam that a
plugin implements (ZMQ over TCP in ``kvconnectors-p2p``, NIXL in ``kvconnectors-nixl``).
See ``docs/plugin-authors.md``, "P/D disaggregation"."""

from engine.kv_transfer.connector import PDConnector
from engine.kv_transfer.layout import BlockLayout
from engine.kv_transfer.params import (
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    Peer,
    RemotePrefill,
    check_kv_transfer_params,
    prefill_params,
    wants_remote_decode,
)
from engine.kv_transfer.scheduler_half import Hold, PDMeta
from engine.kv_transfer.transport import Read, Transport, TransportContext, TransportEvents

__all__ = [
    "DO_REMOTE_DECODE",
    "DO_REMOTE_PREFILL",
    "BlockLayout",
    "Hold",
    "PDConnector",
    "PDMeta",
    "Peer",
    "Read",
    "RemotePrefill",
    "Transport",
    "TransportContext",
    "TransportEvents",
    "check_kv_transfer_params",
    "prefill_params",
    "wants_remote_decode",
]
