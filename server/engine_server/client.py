"""The API process's handle on the engine-core process: starts it, sends requests and
aborts, routes each step's deltas to the HTTP request that owns them, and notices when
the core dies (every open request then gets :class:`EngineDead`)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio

from engine.sampling_params import SamplingParams
from engine_server import protocol

logger = logging.getLogger("engine_server")


class EngineDead(RuntimeError):
    pass


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
    def __init__(self, engine_options: dict, on_death: Callable[[str], None] | None = None):
        self.options = engine_options
        self.on_death = on_death
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
        self._send.bind(to_core)
        self._recv = self._ctx.socket(zmq.PULL)
        self._recv.bind(from_core)
        self.process = subprocess.Popen([sys.executable, "-m", "engine_server.core_process", "--input", to_core,
                                         "--output", from_core, "--options", json.dumps(self.options)])
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

    def submit(self, children: list[tuple[str, list[int], SamplingParams]], priority: int = 0,
               cache_salt: str | None = None) -> RequestHandle:
        if self.dead:
            raise EngineDead(self.dead)
        handle = RequestHandle(self, [rid for rid, _, _ in children])
        for rid, prompt, params in children:
            self._routes[rid] = handle
            self._send.send(protocol.encode(protocol.AddRequest(rid, prompt, params.to_dict(), priority, cache_salt)))
        return handle

    def abort(self, request_ids) -> None:
        request_ids = list(request_ids)
        if request_ids and not self.dead:
            self._send.send(protocol.encode(protocol.Abort(request_ids)))

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

    def _die(self, reason: str) -> None:
        if self.dead:
            return
        self.dead = reason
        logger.error("%s", reason)
        for handle in set(self._routes.values()):
            handle.queue.put_nowait(EngineDead(reason))
        if self.on_death is not None:
            self.on_death(reason)

    async def shutdown(self) -> None:
        self.ready = None  # a normal exit from here on is not a death
        for task in self._tasks:
            task.cancel()
        if self.process is not None and self.process.poll() is None:
            self._send.send(protocol.encode(protocol.Shutdown()))
            try:
                await asyncio.wait_for(asyncio.to_thread(self.process.wait), 15)
            except TimeoutError:
                self.process.kill()
        self._send.close(linger=0)
        self._recv.close(linger=0)
        self._ctx.term()
        self._sync_ctx.term()
        for name in os.listdir(self._dir):
            os.unlink(os.path.join(self._dir, name))
        os.rmdir(self._dir)
