"""Transport: the narrow seam under :class:`engine.kv_transfer.PDConnector`. A P/D connector
plugin supplies one (``kvconnectors-p2p``: ZMQ over TCP; ``kvconnectors-nixl``: NIXL); the
request bookkeeping of both halves, the delayed free with its timeout, the params exchange and
the failure handling are the connector's and the same for every transport.

One transport object lives in the worker half of each instance and is called from the engine's
step thread only; it may run threads of its own. A prefill instance's transport serves reads of
the blocks it was told to ``expose``; a decode instance's pulls blocks with ``read``. Contract:

- ``read`` returns at once; the read's end (success or failure) is reported by a later ``poll``,
  exactly once, and once reported nothing writes into its ``local_block_ids`` any more (the
  engine may reuse them). A read that cannot finish within ``TransportContext.transfer_timeout``
  seconds (a dead or silent peer) is reported failed; a transport should notice a dead peer
  sooner when it can (a closed connection).
- Before its first transfer with a peer a transport compares the peer's
  :class:`~engine.kv_transfer.BlockLayout` with its own (``layout.mismatch``) and the peer's
  engine id with ``Peer.engine_id``; on any difference the reads fail, naming it in the log.
- ``withdraw`` returns only when no read of those blocks is under way and none will start
  (after it the engine frees them). A read that arrives for blocks not (yet) exposed may wait up
  to ``transfer_timeout`` for them: the prefill instance exposes a request's blocks one step
  after it handed on the params.
- ``release`` tells the peer it may free a request's blocks; it is fire-and-forget (a dead peer
  has nothing left to free). The peer's ``poll`` reports it in ``released``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import attrs
import torch

from engine.kv_transfer.layout import BlockLayout
from engine.kv_transfer.params import Peer


@attrs.frozen
class TransportContext:
    engine_id: str  # this instance's (peers address reads to it)
    host: str  # where a serving transport listens (kv_transfer_config kv_ip / kv_port)
    port: int
    serves: bool  # kv_producer or kv_both: other instances read from this one
    layout: BlockLayout
    transfer_timeout: float  # seconds a read may take before it is reported failed
    extra_config: dict = attrs.Factory(dict)  # kv_connector_extra_config (the transport's own keys)


@attrs.frozen
class Read:
    """Pull the peer's ``remote_block_ids`` (held for its request ``remote_request_id``) into this
    instance's ``local_block_ids``: same length, block i into block i, every layer."""

    request_id: str  # this instance's request
    peer: Peer
    remote_request_id: str
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]


@attrs.frozen
class TransportEvents:
    """What happened since the last ``poll``."""

    reads_done: dict[str, bool] = attrs.Factory(dict)  # request id -> every block landed intact
    released: frozenset[str] = frozenset()  # exposed request ids a peer said it is done with
    loaded_bytes: int = 0  # what the finished reads moved, and how long they took
    load_seconds: float = 0.0


class Transport(ABC):
    EXTRA_KEYS: tuple[str, ...] = ()  # kv_connector_extra_config keys this transport reads

    def __init__(self, ctx: TransportContext):
        self.ctx = ctx

    @abstractmethod
    def start(self, kv_caches: list[torch.Tensor], block_dim: int) -> None:
        """Register the engine's caches (one tensor per layer; ``index_select(block_dim, ids)``
        takes blocks); a serving transport starts listening at ``ctx.host:ctx.port``."""

    @abstractmethod
    def expose(self, request_id: str, block_ids: list[int]) -> None:
        """A prefill instance's request holds these blocks for a decode instance to read."""

    @abstractmethod
    def withdraw(self, request_id: str) -> None:
        """Stop serving the request's blocks; no read of them is under way once this returns."""

    @abstractmethod
    def read(self, read: Read) -> None:
        """Start pulling the blocks; the result comes in a later :meth:`poll`."""

    @abstractmethod
    def release(self, peer: Peer, remote_request_id: str) -> None:
        """Tell the peer this instance is done with its request's blocks."""

    @abstractmethod
    def poll(self) -> TransportEvents:
        """Reads finished and releases received since the last call."""

    @abstractmethod
    def close(self) -> None:
        """Stop threads and close connections (the engine is stopping)."""
