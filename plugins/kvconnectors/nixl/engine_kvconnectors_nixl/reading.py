"""Reader: the decode side. Per prefill instance one link (a ZMQ DEALER with a monitor, so a
closed connection fails its reads at once): a hello before the first read (the peer's NIXL
metadata and memory; both sides compare their block layouts and engine ids and refuse a
difference, naming it), then per read a lease and, once granted, one NIXL READ of every layer's
runs of the blocks, which notifies the peer with the lease id when complete.

A read ends exactly once: done when NIXL says DONE within ``transfer_timeout``; failed on a
refusal, an error, a dead link, or the timeout (then the transfer is cancelled, and while NIXL
cannot cancel it the failure waits, so nothing writes into the blocks once it is reported).
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid

import attrs
import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.kv_transfer import BlockLayout, Peer, Read
from engine_kvconnectors_nixl import wire
from engine_kvconnectors_nixl.agent import DONE, ERR, PROC, Agent
from engine_kvconnectors_nixl.results import Results

logger = logging.getLogger(__name__)

PEER_DOWN = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED


@attrs.define(eq=False)
class _Link:
    peer: Peer
    dealer: zmq.Socket
    monitor: zmq.Socket
    state: str = "idle"  # idle (no hello yet), hello (sent), ready
    agent: str = ""  # the peer's NIXL agent, once its hello is in
    waiting: list[str] = attrs.Factory(list)  # lease ids asked for once ready

    @property
    def address(self) -> str:
        return f"{self.peer.host}:{self.peer.port}"


@attrs.define(eq=False)
class _Pending:
    lease_id: str
    read: Read
    link: _Link
    deadline: float
    started: float
    handle: object = None  # the NIXL transfer, once the lease is granted
    cancelling: bool = False


class Reader:
    def __init__(
        self, zmq_context, poller, agent: Agent, layout: BlockLayout, timeout: float, results: Results
    ):
        self.zmq, self.poller, self.agent = zmq_context, poller, agent
        self.layout, self.timeout, self.results = layout, timeout, results
        self.links: dict[str, _Link] = {}  # "host:port" -> link
        self.sockets: dict[zmq.Socket, _Link] = {}  # its dealer and monitor -> link
        self.pending: dict[str, _Pending] = {}  # lease id -> read
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:12]

    @property
    def transferring(self) -> bool:
        return any(p.handle is not None for p in self.pending.values())

    # -- the engine's orders -------------------------------------------------------------
    def read(self, read: Read) -> None:
        lease_id = f"{self._prefix}:{next(self._ids)}"
        link = self._link(read.peer)
        now = time.monotonic()
        self.pending[lease_id] = _Pending(lease_id, read, link, now + self.timeout, now)
        if link.state == "ready":
            self._ask(lease_id)
            return
        link.waiting.append(lease_id)
        if link.state == "idle":
            link.dealer.send_multipart(
                [
                    wire.HELLO,
                    wire.header(
                        engine_id=read.peer.engine_id, agent=self.agent.name, layout=self.layout.to_dict()
                    ),
                    self.agent.metadata(),
                ]
            )
            link.state = "hello"

    def release(self, peer: Peer, remote_request_id: str) -> None:
        self._link(peer).dealer.send_multipart(
            [wire.RELEASE, wire.header(engine_id=peer.engine_id, request_id=remote_request_id)]
        )

    def _link(self, peer: Peer) -> _Link:
        address = f"{peer.host}:{peer.port}"
        link = self.links.get(address)
        if link is None:
            dealer = self.zmq.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            monitor = dealer.get_monitor_socket(PEER_DOWN)
            dealer.connect(wire.endpoint(peer.host, peer.port))
            link = self.links[address] = _Link(peer, dealer, monitor)
            for sock in (dealer, monitor):
                self.sockets[sock] = link
                self.poller.register(sock, zmq.POLLIN)
        return link

    def _ask(self, lease_id: str) -> None:
        pending = self.pending[lease_id]
        read = pending.read
        pending.link.dealer.send_multipart(
            [
                wire.LEASE,
                wire.header(
                    id=lease_id,
                    engine_id=read.peer.engine_id,
                    agent=self.agent.name,
                    request_id=read.remote_request_id,
                    block_ids=list(read.remote_block_ids),
                ),
            ]
        )

    # -- the link's messages --------------------------------------------------------------
    def on_ready(self, sock) -> None:
        link = self.sockets[sock]
        if sock is link.monitor:
            recv_monitor_message(sock)
            self._drop(link, f"the connection to {link.address} is down")
            return
        frames = sock.recv_multipart()
        try:
            head = wire.parse(frames[1])
        except (ValueError, IndexError):
            logger.warning(
                "nixl: a reply from %s that is not one (%d frames); ignored", link.address, len(frames)
            )
            return
        kind = frames[0]
        if kind == wire.HELLO:
            self._on_hello(link, head, frames[2] if len(frames) > 2 else b"")
        elif kind == wire.GRANT:
            self._on_grant(str(head.get("id")))
        elif kind == wire.ERR and head.get("id") == wire.HELLO_ID:
            self._drop(link, f"{link.address} refused: {head.get('error')}")
        elif kind == wire.ERR:
            pending = self.pending.get(str(head.get("id")))
            if pending is not None and pending.handle is None:
                logger.warning(
                    "nixl: reading request %s's KV blocks from %s was refused: %s (it is recomputed)",
                    pending.read.request_id,
                    link.address,
                    head.get("error"),
                )
                self._finish(pending, False)

    def _on_hello(self, link: _Link, head: dict, metadata: bytes) -> None:
        try:
            problem = self._hello_problem(link, head)
            if problem is None:
                agent = str(head.get("agent"))
                self.agent.load(agent, bytes(metadata))
                self.agent.prepare(agent, self.agent.regions.peer(head.get("regions") or {}))
                link.agent, link.state = agent, "ready"
        except Exception as exc:  # noqa: BLE001 - NIXL refusing the metadata fails this peer's reads
            problem = f"NIXL could not load {link.address}'s agent: {exc}"
        if problem is not None:
            self._drop(link, problem)
            return
        waiting, link.waiting = link.waiting, []
        for lease_id in waiting:
            self._ask(lease_id)

    def _hello_problem(self, link: _Link, head: dict) -> str | None:
        if head.get("engine_id") != link.peer.engine_id:
            return f"{link.address} is engine {head.get('engine_id')!r}, not {link.peer.engine_id!r}"
        try:
            mismatch = self.layout.mismatch(BlockLayout.from_dict(head.get("layout") or {}))
        except ValueError as exc:
            return str(exc)
        if mismatch:
            return "the KV block layouts differ (decode here, prefill there): " + "; ".join(mismatch)
        return None

    def _on_grant(self, lease_id: str) -> None:
        pending = self.pending.get(lease_id)
        if pending is None or pending.handle is not None:
            return  # it timed out meanwhile: the lease runs out on the peer
        read = pending.read
        try:
            pending.handle, state = self.agent.read(
                pending.link.agent, read.remote_block_ids, read.local_block_ids, lease_id.encode()
            )
        except Exception as exc:  # noqa: BLE001 - NIXL's errors (a peer gone since its hello) fail the read
            logger.warning(
                "nixl: reading request %s's KV blocks from %s failed: %s (it is recomputed)",
                read.request_id,
                pending.link.address,
                exc,
            )
            self._finish(pending, False)
            return
        if state != PROC:
            self._settle(pending, state)

    # -- progress ----------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        for pending in list(self.pending.values()):
            if pending.handle is None:
                if pending.deadline <= now:
                    self._fail_late(pending, "no lease granted")
                continue
            state = self.agent.state(pending.handle)
            if pending.cancelling:
                if state != PROC:
                    self._finish(pending, False)
            elif pending.deadline <= now:
                self._fail_late(pending, "the transfer did not complete")
            elif state != PROC:
                self._settle(pending, state)

    def _settle(self, pending: _Pending, state: str) -> None:
        if state == ERR:
            logger.warning(
                "nixl: reading request %s's KV blocks from %s failed in NIXL (it is recomputed)",
                pending.read.request_id,
                pending.link.address,
            )
        self._finish(pending, state == DONE)

    def _fail_late(self, pending: _Pending, what: str) -> None:
        logger.warning(
            "nixl: reading request %s's KV blocks from %s: %s within %g s (transfer_timeout); "
            "it is recomputed",
            pending.read.request_id,
            pending.link.address,
            what,
            self.timeout,
        )
        if pending.handle is not None and not Agent.release(pending.handle):
            pending.cancelling = True  # NIXL cannot cancel it: fail it once it stops
            return
        pending.handle = None
        self._finish(pending, False)

    def _finish(self, pending: _Pending, ok: bool) -> None:
        del self.pending[pending.lease_id]
        if pending.lease_id in pending.link.waiting:
            pending.link.waiting.remove(pending.lease_id)
        if pending.handle is not None:
            Agent.release(pending.handle)
        nbytes = len(pending.read.local_block_ids) * self.agent.regions.block_bytes if ok else 0
        self.results.read_done(
            pending.read.request_id, ok, nbytes, time.monotonic() - pending.started if ok else 0.0
        )

    def _drop(self, link: _Link, reason: str) -> None:
        """Forget a link; its reads not transferring yet fail (those transferring end in NIXL)."""
        lost = [p for p in self.pending.values() if p.link is link and p.handle is None]
        if lost:
            logger.warning(
                "nixl: cannot read KV blocks from prefill instance %r: %s; %d request(s) recompute "
                "their prompt (%s)",
                link.peer.engine_id,
                reason,
                len(lost),
                ", ".join(p.read.request_id for p in lost),
            )
        for pending in lost:
            self._finish(pending, False)
        for sock in (link.dealer, link.monitor):
            self.poller.unregister(sock)
            del self.sockets[sock]
            sock.close(linger=0)
        self.links.pop(link.address, None)

    def close(self) -> None:
        """The transport stops: every read ends (failed), every link closes."""
        for pending in list(self.pending.values()):
            self._finish(pending, False)
        for link in list(self.links.values()):
            self._drop(link, "the transport stops")
