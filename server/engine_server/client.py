"""The API process's handle on the engine-core process: starts it, sends requests and
aborts, routes each step's deltas to the HTTP request that owns them, and notices when
the core dies (every open request then gets :class:`EngineDead`).

Nothing here can block forever: sends never wait (no high-water mark, ``NOBLOCK``; the
only refusal is "no core connected", i.e. it died) and :meth:`EngineClient.shutdown`
gives the core a bounded time to exit before killing it."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio

from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine_server import protocol

logger = logging.getLogger("engine_server")

SHUTDOWN_TIMEOUT = 10.0  # seconds the core gets to exit after Shutdown before it is killed
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}  # the core ignores these: the API process decides


class EngineDead(RuntimeError):
    """The engine cannot finish this request because its core died (the HTTP status and
    error code its client gets)."""

    status, code, what = 500, "engine_dead", "the engine core died"


class ShutdownCut(EngineDead):
    """The server's shutdown reached ``--graceful-timeout`` before this request finished."""

    status, code, what = 503, "shutdown", "the server is shutting down"


class RequestHandle:
    """The engine requests behind one HTTP request (one per prompt and sample)."""

    def __init__(self, client: EngineClient, request_ids: list[str]):
        self.client = client
        self.open = set(request_ids)
        self.queue: asyncio.Queue = asyncio.Queue()

    async def deltas(self) -> AsyncIterator[protocol.Delta]:
        while self.open:
            item = await self.queue.get()
            if isinstance(item, EngineDead):
                raise item
            if item.request_id not in self.open:  # already aborted here
                continue
            if item.finish_reason is not None:
                self.open.discard(item.request_id)
            yield item

    def abort(self, request_ids) -> None:
        ids = [r for r in request_ids if r in self.open]
        self.open.difference_update(ids)
        self.client.abort(ids)

    def close(self) -> None:
        """Abort whatever is unfinished (client gone, error) and stop routing."""
        self.abort(list(self.open))
        self.client.release(self)


class EngineClient:
    def __init__(self, engine_options: dict, on_death: Callable[[str], None] | None = None,
                 cpus: set[int] | None = None, rank: int = 0):
        self.options = engine_options
        self.on_death = on_death
        self.cpus = cpus  # the CPUs the core is pinned to (None: this process's)
        self.rank = rank  # among the server's data-parallel cores
        self.ready: protocol.Ready | None = None
        self.dead: str | None = None
        self.stats: dict[str, float] = {}
        self.stats_listeners: list[Callable[[dict], None]] = []
        self._routes: dict[str, RequestHandle] = {}
        self._tasks: list[asyncio.Task] = []
        self._dir = tempfile.mkdtemp(prefix="engine-ipc-")
        self.process: subprocess.Popen | None = None

    async def start(self, timeout: float = 900) -> protocol.Ready:
        self._ctx = zmq.asyncio.Context()
        self._sync_ctx = zmq.Context()
        to_core, from_core = (f"ipc://{os.path.join(self._dir, n)}" for n in ("to-core", "from-core"))
        self._send = self._sync_ctx.socket(zmq.PUSH)  # sends never block; usable from finally blocks
        self._send.setsockopt(zmq.SNDHWM, 0)  # a busy core's backlog queues here instead of blocking
        self._send.bind(to_core)
        self._recv = self._ctx.socket(zmq.PULL)
        self._recv.bind(from_core)
        self.process = _spawn_core(["--input", to_core, "--output", from_core, "--options",
                                    json.dumps(self.options), "--parent-pid", str(os.getpid()),
                                    "--data-parallel-rank", str(self.rank)], self.cpus)
        try:
            return await self._wait_ready(timeout)
        except BaseException:
            self.process.kill()  # a core that never became ready must not outlive us
            raise

    async def _wait_ready(self, timeout: float) -> protocol.Ready:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.ready is None:
            if self.process.poll() is not None:
                raise EngineDead(f"engine core exited with code {self.process.returncode} while starting")
            if loop.time() > deadline:
                raise EngineDead("engine core did not become ready in time")
            if await self._recv.poll(200):
                message = protocol.decode_from_core(await self._recv.recv())
                if isinstance(message, protocol.Fatal):
                    raise EngineDead(message.message)
                if isinstance(message, protocol.Ready):
                    self.ready = message
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]
        return self.ready

    def submit(self, children: list[tuple[str, list[int], SamplingParams | PoolingParams]], priority: int = 0,
               cache_salt: str | None = None, kv_transfer_params: dict | None = None) -> RequestHandle:
        if self.dead:
            raise EngineDead(self.dead)
        handle = RequestHandle(self, [rid for rid, _, _ in children])
        for rid, _, _ in children:
            self._routes[rid] = handle
        batch = protocol.AddBatch([protocol.AddRequest(rid, prompt, params.to_dict(), priority, cache_salt,
                                                       pooling=isinstance(params, PoolingParams),
                                                       kv_transfer_params=kv_transfer_params)
                                   for rid, prompt, params in children])
        if not self._post(batch):
            self.release(handle)
            raise EngineDead("the engine core is not connected")
        return handle

    @property
    def open_requests(self) -> int:
        """Engine requests sent and not yet finished."""
        return len(self._routes)

    def routes(self, request_id: str) -> bool:
        """Whether ``request_id`` is one of this core's open requests."""
        return request_id in self._routes

    def abort(self, request_ids) -> None:
        request_ids = list(request_ids)
        if request_ids and not self.dead:
            self._post(protocol.Abort(request_ids))

    def _post(self, message) -> bool:
        """Queue ``message`` for the core without blocking. The socket has no high-water mark,
        so the only refusal (False) is no connected core: it died, or we shut down."""
        if self._send.closed:
            return False
        try:
            self._send.send(protocol.encode(message), flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def cut_open_requests(self) -> int:
        """End every open request with :class:`ShutdownCut` (its stream gets an error frame,
        a response waiting for it a 503); returns how many HTTP requests were cut."""
        return self._fail_all(ShutdownCut, "it did not finish within --graceful-timeout")

    def release(self, handle: RequestHandle) -> None:
        for rid in [r for r, h in self._routes.items() if h is handle]:
            del self._routes[rid]

    async def _receive(self) -> None:
        while True:
            message = protocol.decode_from_core(await self._recv.recv())
            if isinstance(message, protocol.Fatal):
                self._die(f"engine core failed: {message.message.strip().splitlines()[-1]}")
                return
            for delta in message.deltas:
                handle = self._routes.get(delta.request_id)
                if handle is not None:
                    handle.queue.put_nowait(delta)
            if message.stats is not None:
                self.stats = message.stats
                for listener in self.stats_listeners:
                    listener(message.stats)

    async def _watch(self) -> None:
        while self.process.poll() is None:
            await asyncio.sleep(0.2)
        if self.ready is not None:
            self._die(f"engine core exited unexpectedly with code {self.process.returncode}")

    def fail(self, reason: str) -> None:
        """Treat the core as dead for ``reason`` (it may still run: shutdown kills it)."""
        self._die(reason)

    def _die(self, reason: str) -> None:
        if self.dead:
            return
        self.dead = reason
        logger.error("%s", reason)
        self._fail_all(EngineDead, reason)
        if self.on_death is not None:
            self.on_death(reason)

    def _fail_all(self, kind: type[EngineDead], reason: str) -> int:
        handles = set(self._routes.values())
        for handle in handles:
            handle.queue.put_nowait(kind(reason))
        return len(handles)

    async def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT) -> None:
        """Stop the core and release the sockets in bounded time: Shutdown is posted (to a core
        that died unnoticed it is simply not delivered), the core gets ``timeout`` seconds to
        exit, then SIGKILL; a core known to have failed is killed at once."""
        self.ready = None  # a normal exit from here on is not a death
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.process is not None and self.process.poll() is None:
            if self.dead:  # it failed and is on its way out: its teardown saves nothing
                self.process.kill()
            else:
                self._post(protocol.Shutdown())
            if not await _exited(self.process, timeout):
                logger.warning("engine core did not exit within %.0f s of shutdown; killing it", timeout)
                self.process.kill()
                await _exited(self.process, timeout)
        self._ctx.destroy(linger=0)
        self._sync_ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)


def _spawn_core(arguments: list[str], cpus: set[int] | None = None) -> subprocess.Popen:
    """Start ``python -m engine_server.core_process`` with SIGINT/SIGTERM blocked: the blocked
    mask survives exec, and the core ignores both before it unblocks them, so a signal sent
    to the whole process group (Ctrl-C, systemd, a container stop) cannot kill it even while
    it imports; only the API process tells it to stop. With ``cpus`` the core is pinned to
    them as it starts (long before it imports torch and sizes its thread pool from them)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        process = subprocess.Popen([sys.executable, "-m", "engine_server.core_process", *arguments])
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    if cpus is not None:
        os.sched_setaffinity(process.pid, cpus)
    return process


async def _exited(process: subprocess.Popen, timeout: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while process.poll() is None:
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True
