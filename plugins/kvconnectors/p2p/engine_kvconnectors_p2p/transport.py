"""ZmqTransport: the p2p connector's transport (``engine.kv_transfer.Transport``).

One thread per instance owns every socket: a ROUTER bound at ``kv_ip:kv_port`` when the instance
serves (prefill side), one DEALER per prefill instance it reads from (decode side), each DEALER
with a monitor so a peer's closed connection fails its reads at once, and an inproc PULL the
engine's step thread wakes it through. A read is one request and one reply (:mod:`.wire`): the
reply carries the blocks, one frame per layer, which the thread copies into the decode
instance's blocks before the read is reported done. The served blocks are copied under a lock
that ``withdraw`` also takes, so once it returns no read of them is under way.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict

import attrs
import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.kv_transfer import BlockLayout, Peer, Read, Transport, TransportEvents
from engine_kvconnectors_p2p import wire

logger = logging.getLogger(__name__)

PEER_DOWN = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
TICK_MS = 20  # the thread's longest sleep while reads wait (deadlines, blocks not yet exposed)
REMEMBERED_WITHDRAWALS = 4096


@attrs.define
class _Pending:
    read: Read
    address: str
    deadline: float
    started: float


@attrs.define
class _Parked:
    """A read served once its request's blocks are exposed (the prefill side exposes them one
    step after it handed the params on)."""

    identity: bytes
    head: dict
    deadline: float


class _Results:
    """What the thread hands the step thread's ``poll`` (under a lock)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.done: dict[str, bool] = {}
        self.released: set[str] = set()
        self.bytes, self.seconds = 0, 0.0

    def take(self) -> TransportEvents:
        with self.lock:
            events = TransportEvents(self.done, frozenset(self.released), self.bytes, self.seconds)
            self.done, self.released, self.bytes, self.seconds = {}, set(), 0, 0.0
        return events


class ZmqTransport(Transport):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.caches, self.block_dim = [], 0
        self._zmq = zmq.Context()
        self._wake_address = f"inproc://p2p-wake-{uuid.uuid4().hex}"
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._exposed: dict[str, frozenset[int]] = {}
        self._withdrawn: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()  # _exposed / _withdrawn against a read being served
        self._results = _Results()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._wake = None

    # -- the step thread ------------------------------------------------------------------
    def start(self, kv_caches, block_dim):
        self.caches, self.block_dim = list(kv_caches), block_dim
        router = None
        if self.ctx.serves:
            router = self._zmq.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            try:
                router.bind(f"tcp://{_bracketed(self.ctx.host)}:{self.ctx.port}")
            except zmq.ZMQError as exc:
                router.close()
                raise ValueError(
                    f"kv_transfer_config: cannot listen on {self.ctx.host}:{self.ctx.port} "
                    f"(kv_ip, kv_port): {exc}"
                ) from None
        inbox = self._zmq.socket(zmq.PULL)
        inbox.bind(self._wake_address)
        self._wake = self._zmq.socket(zmq.PUSH)
        self._wake.connect(self._wake_address)
        loop = _Loop(self, router, inbox)
        self._thread = threading.Thread(target=loop.run, name="p2p-transport", daemon=True)
        self._thread.start()

    def expose(self, request_id, block_ids):
        with self._lock:
            self._exposed[request_id] = frozenset(block_ids)
        self._send_command(("exposed",))

    def withdraw(self, request_id):
        with self._lock:  # waits for a read of them being copied
            self._exposed.pop(request_id, None)
            self._withdrawn[request_id] = None
            while len(self._withdrawn) > REMEMBERED_WITHDRAWALS:
                self._withdrawn.popitem(last=False)

    def read(self, read):
        self._send_command(("read", read))

    def release(self, peer, remote_request_id):
        self._send_command(("release", peer, remote_request_id))

    def poll(self):
        return self._results.take()

    def close(self):
        if self._zmq.closed:
            return
        if self._thread is not None:
            self._send_command(("stop",))
            self._thread.join(timeout=10)
            self._wake.close(linger=0)
            if self._thread.is_alive():  # stuck: leave its sockets (a daemon thread) rather than hang
                logger.warning("p2p: the transport thread did not stop")
                return
            self._thread = None
        self._zmq.term()

    def _send_command(self, command) -> None:
        self._commands.put(command)
        try:
            self._wake.send(b"", flags=zmq.NOBLOCK)
        except zmq.Again:  # wake-ups queued already: the thread drains every command when it wakes
            pass


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class _Loop:
    """The transport thread: every socket is created, used and closed here (``router`` and
    ``inbox`` were made by the step thread before it started)."""

    def __init__(self, transport: ZmqTransport, router, inbox):
        self.t = transport
        self.router, self.inbox = router, inbox
        self.layout: BlockLayout = transport.ctx.layout
        self.poller = zmq.Poller()
        self.poller.register(inbox, zmq.POLLIN)
        if router is not None:
            self.poller.register(router, zmq.POLLIN)
        self.dealers: dict[str, zmq.Socket] = {}  # "host:port" -> DEALER
        self.monitors: dict[zmq.Socket, str] = {}  # monitor socket -> "host:port"
        self.pending: dict[str, _Pending] = {}  # read id -> our read in flight
        self.parked: list[_Parked] = []  # reads of ours served once exposed
        self.running = True

    def run(self) -> None:
        try:
            while self.running:
                waiting = self.pending or self.parked
                for sock, _ in self.poller.poll(TICK_MS if waiting else 200):
                    try:
                        self._on_ready(sock)
                    except Exception:  # one bad message must not stop the transport
                        logger.exception("p2p: handling a message failed")
                self._serve_parked()
                self._expire()
        finally:
            for read_id in list(self.pending):
                self._finish(self.pending.pop(read_id), False)
            self._close()

    def _on_ready(self, sock) -> None:
        if sock is self.inbox:
            self._commands()
        elif sock is self.router:
            self._serve(sock.recv_multipart(copy=False))
        elif sock in self.monitors:
            self._on_monitor(sock)
        else:
            self._on_reply(sock.recv_multipart(copy=False))

    # -- commands from the step thread -----------------------------------------------------
    def _commands(self) -> None:
        while self.inbox.poll(0):
            self.inbox.recv()
        while True:
            try:
                command = self.t._commands.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "read":
                self._start_read(command[1])
            elif kind == "release":
                _, peer, remote_request_id = command
                self._dealer(peer).send_multipart(
                    [wire.RELEASE, wire.header(engine_id=peer.engine_id, request_id=remote_request_id)]
                )
            elif kind == "stop":
                self.running = False
                return

    def _start_read(self, read: Read) -> None:
        read_id = f"{read.request_id}#{next(self.t._ids)}"
        now = time.monotonic()
        address = _address(read.peer)
        self.pending[read_id] = _Pending(read, address, now + self.t.ctx.transfer_timeout, now)
        self._dealer(read.peer).send_multipart(
            [
                wire.READ,
                wire.header(
                    id=read_id,
                    engine_id=read.peer.engine_id,
                    request_id=read.remote_request_id,
                    block_ids=list(read.remote_block_ids),
                    layout=self.layout.to_dict(),
                ),
            ]
        )

    def _dealer(self, peer: Peer):
        address = _address(peer)
        dealer = self.dealers.get(address)
        if dealer is None:
            dealer = self.t._zmq.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            monitor = dealer.get_monitor_socket(PEER_DOWN)
            dealer.connect(f"tcp://{_bracketed(peer.host)}:{peer.port}")
            self.dealers[address] = dealer
            self.monitors[monitor] = address
            self.poller.register(dealer, zmq.POLLIN)
            self.poller.register(monitor, zmq.POLLIN)
        return dealer

    # -- the decode side: replies and dead peers ----------------------------------------------
    def _on_reply(self, frames) -> None:
        try:
            head = wire.parse(frames[1])
        except (ValueError, IndexError):
            logger.warning("p2p: a reply that is not one (%d frames); ignored", len(frames))
            return
        pending = self.pending.pop(str(head.get("id")), None)
        if pending is None:
            return  # a read already failed (timeout, dead peer): nothing may be written now
        if frames[0].bytes != wire.OK:
            logger.warning(
                "p2p: reading request %s's KV blocks from %s failed: %s (it is recomputed)",
                pending.read.request_id,
                pending.address,
                head.get("error"),
            )
            self._finish(pending, False)
            return
        try:
            wire.write_blocks(
                self.t.caches,
                self.t.block_dim,
                pending.read.local_block_ids,
                [frame.buffer for frame in frames[2:]],
            )
        except ValueError as exc:
            logger.warning(
                "p2p: request %s: a malformed reply from %s: %s (it is recomputed)",
                pending.read.request_id,
                pending.address,
                exc,
            )
            self._finish(pending, False)
            return
        self._finish(pending, True, sum(len(frame.buffer) for frame in frames[2:]))

    def _on_monitor(self, monitor) -> None:
        recv_monitor_message(monitor)  # a disconnection or a refused connection attempt
        address = self.monitors[monitor]
        lost = [read_id for read_id, pending in self.pending.items() if pending.address == address]
        if lost:
            logger.warning(
                "p2p: the connection to %s is down; %d read(s) from it fail (recomputed)", address, len(lost)
            )
        for read_id in lost:
            self._finish(self.pending.pop(read_id), False)

    def _finish(self, pending: _Pending, ok: bool, nbytes: int = 0) -> None:
        results = self.t._results
        with results.lock:
            results.done[pending.read.request_id] = ok
            if ok:
                results.bytes += nbytes
                results.seconds += time.monotonic() - pending.started

    def _expire(self) -> None:
        now = time.monotonic()
        for read_id, pending in list(self.pending.items()):
            if pending.deadline <= now:
                logger.warning(
                    "p2p: reading request %s's KV blocks from %s took over %g s "
                    "(transfer_timeout); it is recomputed",
                    pending.read.request_id,
                    pending.address,
                    self.t.ctx.transfer_timeout,
                )
                del self.pending[read_id]
                self._finish(pending, False)
        for parked in [p for p in self.parked if p.deadline <= now]:
            self.parked.remove(parked)
            self._reply_error(
                parked.identity,
                parked.head,
                f"request {parked.head.get('request_id')!r} holds no "
                f"blocks here (not within {self.t.ctx.transfer_timeout:g} s)",
            )

    # -- the prefill side: serving reads --------------------------------------------------------
    def _serve(self, frames) -> None:
        try:
            if len(frames) < 3:
                raise ValueError(f"{len(frames)} frames")
            identity, kind, head = frames[0].bytes, frames[1], wire.parse(frames[2])
        except ValueError as exc:
            logger.warning("p2p: ignoring a message that is not one: %s", exc)
            return
        if kind.bytes == wire.RELEASE:
            if head.get("engine_id") == self.t.ctx.engine_id:
                with self.t._results.lock:
                    self.t._results.released.add(str(head.get("request_id")))
            return
        if kind.bytes != wire.READ:
            return
        problem = self._refusal(head)
        if problem:
            self._reply_error(identity, head, problem)
            return
        self._serve_read(identity, head, time.monotonic() + self.t.ctx.transfer_timeout)

    def _refusal(self, head: dict) -> str | None:
        if head.get("engine_id") != self.t.ctx.engine_id:
            return f"this instance's engine id is {self.t.ctx.engine_id!r}, not {head.get('engine_id')!r}"
        try:
            theirs = BlockLayout.from_dict(head.get("layout") or {})
        except ValueError as exc:
            return str(exc)
        mismatch = self.layout.mismatch(theirs)
        if mismatch:
            return "the KV block layouts differ (prefill here, decode there): " + "; ".join(mismatch)
        block_ids = head.get("block_ids")
        if not isinstance(block_ids, list) or not all(isinstance(b, int) for b in block_ids):
            return "block_ids: not a list of block ids"
        return None

    def _serve_read(self, identity: bytes, head: dict, deadline: float) -> bool:
        """Reply with the blocks, or an error; False (parked) while the request's blocks are not
        exposed yet."""
        request_id = str(head.get("request_id"))
        with self.t._lock:
            exposed = self.t._exposed.get(request_id)
            if exposed is None:
                if request_id in self.t._withdrawn:
                    error = (
                        f"request {request_id!r}'s blocks were freed (read, or abort_request_timeout passed)"
                    )
                    frames = None
                else:
                    self.parked.append(_Parked(identity, head, deadline))
                    return False
            elif not exposed.issuperset(head["block_ids"]):
                error, frames = f"request {request_id!r} does not hold blocks {head['block_ids']}", None
            else:
                error, frames = None, wire.block_frames(self.t.caches, self.t.block_dim, head["block_ids"])
        if frames is None:
            self._reply_error(identity, head, error)
        else:
            self.router.send_multipart(
                [identity, wire.OK, wire.header(id=head.get("id")), *frames], copy=False
            )
        return True

    def _serve_parked(self) -> None:
        if self.parked:
            parked, self.parked = self.parked, []
            for p in parked:
                self._serve_read(p.identity, p.head, p.deadline)

    def _reply_error(self, identity: bytes, head: dict, error: str) -> None:
        self.router.send_multipart([identity, wire.ERR, wire.header(id=head.get("id"), error=error)])

    def _close(self) -> None:
        for monitor in self.monitors:
            monitor.close(linger=0)
        for dealer in self.dealers.values():
            dealer.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)
        self.inbox.close(linger=0)


def _address(peer: Peer) -> str:
    return f"{peer.host}:{peer.port}"
