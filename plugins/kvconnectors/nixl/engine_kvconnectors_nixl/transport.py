"""NixlTransport: the nixl connector's transport (``engine.kv_transfer.Transport``).

The decode instance **reads** (NIXL READ, one-sided) a prompt's blocks out of the prefill
instance's registered caches into its own, other, block ids, as vLLM's NixlConnector does: the
decode instance knows its destination blocks only once it admits the request, long after the
prefill instance finished, and it decides when to pull; the prefill instance takes no part in the
copy. Control goes over a ZMQ side channel at the prefill instance's ``kv_ip:kv_port``
(:mod:`.wire`: hello, lease, release); each read's NIXL notification tells the prefill instance
it is complete (:mod:`.serving` explains the leases).

One thread per instance owns the sockets and makes every NIXL call after ``start``; the engine's
step thread hands it orders through a queue and an inproc wake-up socket.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid

import zmq

from engine.kv_transfer import Transport
from engine_kvconnectors_nixl import wire
from engine_kvconnectors_nixl.agent import Agent
from engine_kvconnectors_nixl.reading import Reader
from engine_kvconnectors_nixl.regions import Regions
from engine_kvconnectors_nixl.results import Results
from engine_kvconnectors_nixl.serving import Server

logger = logging.getLogger(__name__)

DEFAULT_BACKENDS = ("UCX",)
BUSY_MS = 1  # the thread's sleep while NIXL transfers or leases are under way (their state is polled)
WAITING_MS = 20  # ... while reads or leases wait for a reply or for blocks (deadlines)
IDLE_MS = 200


def _backends(extra: dict) -> list[str]:
    backends = extra.get("backends", list(DEFAULT_BACKENDS))
    if not isinstance(backends, list) or not backends or not all(isinstance(b, str) and b for b in backends):
        raise ValueError(
            f"kv_connector_extra_config.backends: a list of NIXL backend names, got {backends!r}"
        )
    return backends


class NixlTransport(Transport):
    EXTRA_KEYS = ("backends",)  # vLLM's NixlConnector key: NIXL backends, default ["UCX"]

    def __init__(self, ctx):
        super().__init__(ctx)
        self.backends = _backends(ctx.extra_config)
        self._zmq = zmq.Context()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._results = Results()
        self._thread: threading.Thread | None = None
        self._wake = None

    # -- the step thread ------------------------------------------------------------------
    def start(self, kv_caches, block_dim):
        agent = Agent(
            self.ctx.engine_id, self.backends, list(kv_caches), Regions.of(list(kv_caches), block_dim)
        )
        try:
            server = Server(self._listen(), self.ctx, agent, self._results) if self.ctx.serves else None
        except Exception:
            agent.close()
            raise
        address = f"inproc://nixl-wake-{uuid.uuid4().hex}"
        inbox = self._zmq.socket(zmq.PULL)
        inbox.bind(address)
        self._wake = self._zmq.socket(zmq.PUSH)
        self._wake.connect(address)
        loop = _Loop(self, agent, inbox, server)
        self._thread = threading.Thread(target=loop.run, name="nixl-transport", daemon=True)
        self._thread.start()

    def _listen(self):
        """The side channel's ROUTER at kv_ip:kv_port (a prefill instance's)."""
        router = self._zmq.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        try:
            router.bind(wire.endpoint(self.ctx.host, self.ctx.port))
        except zmq.ZMQError as exc:
            router.close()
            raise ValueError(
                f"kv_transfer_config: cannot listen on {self.ctx.host}:{self.ctx.port} "
                f"(kv_ip, kv_port): {exc}"
            ) from None
        return router

    def expose(self, request_id, block_ids):
        self._send(("expose", request_id, list(block_ids)))

    def withdraw(self, request_id):
        """Waits for the request's leases (at most ``transfer_timeout``, when a reader died mid-read)."""
        done = threading.Event()
        self._send(("withdraw", request_id, done))
        if not done.wait(self.ctx.transfer_timeout + 5) and self._thread is not None:
            logger.warning("nixl: withdrawing request %s's blocks did not finish in time", request_id)

    def read(self, read):
        self._send(("read", read))

    def release(self, peer, remote_request_id):
        self._send(("release", peer, remote_request_id))

    def poll(self):
        return self._results.take()

    def close(self):
        if self._zmq.closed:
            return
        if self._thread is not None:
            self._send(("stop",))
            self._thread.join(timeout=10)
            if self._thread.is_alive():  # stuck in NIXL: leave it (a daemon thread) rather than hang
                logger.warning("nixl: the transport thread did not stop")
                return
            self._thread = None
        if self._wake is not None:
            self._wake.close(linger=0)
        self._zmq.term()

    def _send(self, command) -> None:
        if self._thread is None:
            if command[0] == "withdraw":
                command[2].set()
            return
        self._commands.put(command)
        try:
            self._wake.send(b"", flags=zmq.NOBLOCK)
        except zmq.Again:  # wake-ups queued already: the thread drains every command when it wakes
            pass


class _Loop:
    """The transport thread."""

    def __init__(self, transport: NixlTransport, agent: Agent, inbox, server: Server | None):
        self.commands = transport._commands
        self.agent, self.inbox, self.server = agent, inbox, server
        self.poller = zmq.Poller()
        self.poller.register(inbox, zmq.POLLIN)
        if server is not None:
            self.poller.register(server.router, zmq.POLLIN)
        self.reader = Reader(
            transport._zmq,
            self.poller,
            agent,
            transport.ctx.layout,
            transport.ctx.transfer_timeout,
            transport._results,
        )
        self.running = True

    def run(self) -> None:
        try:
            while self.running:
                for sock, _ in self.poller.poll(self._sleep_ms()):
                    try:
                        self._on_ready(sock)
                    except Exception:  # one bad message must not stop the transport
                        logger.exception("nixl: handling a side-channel message failed")
                try:
                    self._progress()
                except Exception:  # nor one failed poll of NIXL
                    logger.exception("nixl: polling NIXL failed")
        finally:
            self._close()

    def _sleep_ms(self) -> int:
        serving = self.server is not None and self.server.leases
        if serving or self.reader.transferring:
            return BUSY_MS
        if self.reader.pending or (self.server is not None and self.server.busy):
            return WAITING_MS
        return IDLE_MS

    def _on_ready(self, sock) -> None:
        if sock is self.inbox:
            self._run_commands()
        elif self.server is not None and sock is self.server.router:
            self.server.on_message(sock.recv_multipart(copy=False))
        else:
            self.reader.on_ready(sock)

    def _run_commands(self) -> None:
        while self.inbox.poll(0):
            self.inbox.recv()
        while True:
            try:
                kind, *args = self.commands.get_nowait()
            except queue.Empty:
                return
            if kind == "read":
                self.reader.read(*args)
            elif kind == "release":
                self.reader.release(*args)
            elif kind == "expose" and self.server is not None:
                self.server.expose(*args)
            elif kind == "withdraw":
                if self.server is None:
                    args[1].set()
                else:
                    self.server.withdraw(*args)
            elif kind == "stop":
                self.running = False
                return

    def _progress(self) -> None:
        now = time.monotonic()
        self.reader.tick(now)
        notifications = self.agent.notifications()  # drained on either side (probes come to readers)
        if self.server is not None:
            self.server.on_notifications(notifications)
            self.server.tick(now)

    def _close(self) -> None:
        self.reader.close()
        if self.server is not None:
            self.server.close()
        self.inbox.close(linger=0)
        try:
            self.agent.close()
        except Exception:
            logger.exception("nixl: closing the NIXL agent failed")
