"""The engine-core process's side of liveness: the step loop marks where it is on a
:class:`LoopClock`, and a :class:`HeartbeatThread` of its own sends that to the front end every
:data:`~engine.client.protocol.HEARTBEAT_INTERVAL` seconds.

The beat comes from a thread apart from the step loop so that a long step (a long prefill)
does not silence it: what it reports is whether the loop still goes round. A loop that
deadlocks with its threads alive shows as a round that grows old; a process that is stopped
(SIGSTOP) or held by a native call that keeps the GIL sends nothing, which the front end
reads as silence (:mod:`engine.client.liveness`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import zmq

from engine.client.protocol import HEARTBEAT_INTERVAL, Heartbeat, encode


class LoopClock:
    """Where the step loop is. Written by the loop, read by the heartbeat thread: plain
    attribute writes (atomic under the GIL), so a step pays no lock for it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.round_started = clock()
        self.steps = 0
        self.stepping = False

    def round(self) -> None:
        """The loop begins a round: look for requests, maybe step, send what came out."""
        self.round_started = self._clock()

    def step_started(self) -> None:
        self.stepping = True

    def step_finished(self) -> None:
        self.steps += 1
        self.stepping = False

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(max(0.0, self._clock() - self.round_started), self.steps, self.stepping)


class HeartbeatThread:
    """Sends ``clock``'s :class:`Heartbeat` to ``address`` every ``interval`` seconds, on a
    socket of its own (ZMQ sockets are not shared between threads; the front end's PULL
    socket fair-queues this one with the loop's outputs). A beat the front end is not
    reading is dropped, never queued: a late beat says nothing a fresh one does not."""

    def __init__(
        self, context: zmq.Context, address: str, clock: LoopClock, interval: float = HEARTBEAT_INTERVAL
    ):
        self.context, self.address, self.clock, self.interval = context, address, clock, interval
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Returns once the thread has closed its socket (the context's ``term`` waits for it)."""
        self._halt.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        socket = self.context.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, 2)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.address)
        try:
            while True:
                try:
                    socket.send(encode(self.clock.heartbeat()), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the front end is not reading; it judges the silence itself
                if self._halt.wait(self.interval):
                    return
        finally:
            socket.close()
