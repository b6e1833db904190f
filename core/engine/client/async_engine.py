"""An asyncio front end's engine (vLLM's ``AsyncLLM``): one engine core in its own process
(:class:`AsyncMPClient`), each front-end request's deltas routed to its own
:class:`RequestHandle`, and the core's death noticed (every open request then gets
:class:`EngineDead`). With a step timeout, a core that stops making progress is treated as
dead too (:class:`EngineStalled`), so that a supervisor can restart what would otherwise hold
its requests forever."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import overload

from engine.client.base import Child
from engine.client.mp_client import AsyncMPClient, EngineDead
from engine.client.protocol import Delta, Ready
from engine.messages.lora import LoRARequest
from engine.messages.multimodal import MultiModalItem
from engine.messages.stats import EngineStats

logger = logging.getLogger(__name__)

WATCHDOG_PERIOD = 0.25  # seconds between the step-timeout watchdog's looks (at most)
LOOP_LAG_ALLOWANCE = 0.5  # a look this late means this event loop stalled: the heartbeats may wait unread


class ShutdownCut(EngineDead):
    """The front end's shutdown reached its deadline (the server's ``--graceful-timeout``)
    before this request finished."""

    code, what = "shutdown", "the server is shutting down"


class EngineStalled(EngineDead):
    """The engine core made no progress for longer than the step timeout while requests were
    in flight: stopped, hung in a step, or deadlocked. It is killed as a dead one is."""

    code, what = "engine_stalled", "the engine core stopped making progress"


class RequestHandle:
    """The engine requests behind one front-end request (one per prompt and sample)."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str]):
        self.engine = engine
        self.open = set(request_ids)
        self.queue: asyncio.Queue = asyncio.Queue()

    @overload
    def deltas(self, quiet_after: None = None) -> AsyncIterator[Delta]: ...
    @overload
    def deltas(self, quiet_after: float | None) -> AsyncIterator[Delta | None]: ...

    async def deltas(self, quiet_after: float | None = None) -> AsyncIterator[Delta | None]:
        """The deltas of the open requests until each has finished; with ``quiet_after``, also
        None each time that many seconds pass without one (a stream's keep-alive is due)."""
        while self.open:
            item = await self._next(quiet_after)
            if item is None:
                yield None
                continue
            if isinstance(item, EngineDead):
                raise item
            if item.request_id not in self.open:  # already aborted here
                continue
            if item.finish_reason is not None:
                self.open.discard(item.request_id)
            yield item

    async def _next(self, timeout: float | None) -> Delta | EngineDead | None:
        """The queue's next item, None after ``timeout`` seconds without one. A delta already
        queued costs no wait; a timed-out get leaves the queue as it was (``Queue.get`` is
        safe to cancel), so no delta is lost to a keep-alive."""
        if not self.queue.empty():
            return self.queue.get_nowait()
        if timeout is None:
            return await self.queue.get()
        try:
            async with asyncio.timeout(timeout):
                return await self.queue.get()
        except TimeoutError:
            return None

    def abort(self, request_ids) -> None:
        ids = [r for r in request_ids if r in self.open]
        self.open.difference_update(ids)
        self.engine.abort(ids)

    def close(self) -> None:
        """Abort whatever is unfinished (client gone, error) and stop routing."""
        self.abort(list(self.open))
        self.engine.release(self)


class AsyncEngine:
    def __init__(
        self,
        engine_options: dict,
        on_death: Callable[[str], None] | None = None,
        cpus: set[int] | None = None,
        rank: int = 0,
        step_timeout: float | None = None,
    ):
        """``cpus``: the CPUs the core is pinned to (None: this process's); ``rank``: its place
        among the front end's data-parallel cores; ``step_timeout``: seconds without progress
        (while requests are in flight) after which the core counts as dead (None: never)."""
        self.core = AsyncMPClient(engine_options, cpus, rank)
        self.on_death = on_death
        self.step_timeout = step_timeout
        self.dead: str | None = None
        self.stats_listeners: list[Callable[[EngineStats], None]] = []
        self._routes: dict[str, RequestHandle] = {}
        self._tasks: list[asyncio.Task] = []

    @property
    def ready(self) -> Ready | None:
        return self.core.ready

    def launch(self) -> None:
        """Spawn the core process now; :meth:`start` waits for it (see AsyncMPClient.launch)."""
        self.core.launch()

    def abandon(self) -> None:
        """Kill a launched core that will not be started."""
        self.core.abandon()

    async def start(self, timeout: float = 900) -> Ready:
        ready = await self.core.start(timeout)
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]
        if self.step_timeout:
            self._tasks.append(asyncio.create_task(self._watchdog(self.step_timeout)))
        return ready

    def submit(
        self,
        children: list[Child],
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
        lora_request: LoRARequest | None = None,
        mm_items: tuple[MultiModalItem, ...] = (),
    ) -> RequestHandle:
        if self.dead:
            raise EngineDead(self.dead)
        handle = RequestHandle(self, [rid for rid, _, _ in children])
        for rid, _, _ in children:
            self._routes[rid] = handle
        try:
            self.core.add(children, priority, cache_salt, kv_transfer_params, lora_request, mm_items)
        except EngineDead:
            self.release(handle)
            raise
        return handle

    @property
    def open_requests(self) -> int:
        """Engine requests sent and not yet finished."""
        return len(self._routes)

    def unresponsive(self, limit: float) -> str | None:
        """Why the core shows no progress within ``limit`` seconds while it has requests in
        flight, or None (:meth:`engine.client.liveness.Liveness.problem`)."""
        return self.core.liveness.problem(limit, self.open_requests)

    def routes(self, request_id: str) -> bool:
        """Whether ``request_id`` is one of this core's open requests."""
        return request_id in self._routes

    def abort(self, request_ids) -> None:
        request_ids = list(request_ids)
        if not self.dead:
            self.core.abort(request_ids)

    async def control(self, method: str, **arguments):
        """Call one of the core's control methods (sleep mode, weight updates, the prefix cache)."""
        if self.dead:
            raise EngineDead(self.dead)
        return await self.core.control(method, **arguments)

    def cut_open_requests(self) -> int:
        """End every open request with :class:`ShutdownCut` (its stream gets an error frame,
        a response waiting for it a 503); returns how many front-end requests were cut."""
        return self._fail_all(ShutdownCut, "it did not finish within --graceful-timeout")

    def release(self, handle: RequestHandle) -> None:
        for rid in [r for r, h in self._routes.items() if h is handle]:
            del self._routes[rid]

    async def _receive(self) -> None:
        while True:
            try:
                outputs = await self.core.get_output()
            except EngineDead as exc:
                self._die(str(exc))
                return
            for delta in outputs.deltas:
                handle = self._routes.get(delta.request_id)
                if handle is not None:
                    handle.queue.put_nowait(delta)
            if outputs.stats is not None:
                for listener in self.stats_listeners:
                    listener(outputs.stats)

    async def _watch(self) -> None:
        code = await self.core.exited()
        self._die(f"engine core exited unexpectedly with code {code}")

    async def _watchdog(self, limit: float) -> None:
        """Fails the core once it is unresponsive for ``limit`` seconds. A look that comes late
        is skipped: this event loop was blocked, and heartbeats may be waiting unread."""
        period = min(WATCHDOG_PERIOD, limit / 4)
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            lagged, last = now - last > period + LOOP_LAG_ALLOWANCE, now
            problem = None if lagged else self.unresponsive(limit)
            if problem:
                self._die(f"{problem}; the step timeout is {limit:g} s", EngineStalled)
                return

    def fail(self, reason: str) -> None:
        """Treat the core as dead for ``reason`` (it may still run: shutdown kills it)."""
        self._die(reason)

    def _die(self, reason: str, kind: type[EngineDead] = EngineDead) -> None:
        if self.dead:
            return
        self.dead = reason
        logger.error("%s", reason)
        self._fail_all(kind, reason)
        self.core.fail_calls(reason)
        if self.on_death is not None:
            self.on_death(reason)

    def _fail_all(self, kind: type[EngineDead], reason: str) -> int:
        handles = set(self._routes.values())
        for handle in handles:
            handle.queue.put_nowait(kind(reason))
        return len(handles)

    async def shutdown(self) -> None:
        """Stop routing (a normal exit from here on is not a death), then stop the core."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.core.shutdown(failed=self.dead is not None)
