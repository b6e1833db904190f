"""Data parallelism: ``--data-parallel-size N`` engine cores behind one API server.

Each replica is a whole engine core (its own process, model and KV cache) with its own
:class:`engine.client.AsyncEngine`; a request and its ``n`` samples go to one replica, chosen by the
:class:`Router`. On a CPU the replicas split the API process's cores between them (replica
``i`` is pinned to the ``i``-th share, and sizes its thread pool from that), so N
replicas never fight over the same cores. One replica dying fails the server as a lone
core's death does: every open request gets its error, ``/health`` answers 503 and
``engine serve`` exits non-zero."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable

import zmq.asyncio

from engine.client import AsyncEngine, RequestHandle, kv_events
from engine.lora import LoRARequest
from engine.messages.kv_events import KVEventsConfig
from engine.messages.multimodal import MultiModalItem
from engine.messages.stats import EngineStats
from engine_server.router import Router


def core_shares(num_replicas: int) -> list[set[int] | None]:
    """The CPUs each replica is pinned to: this process's CPUs in ``num_replicas`` equal
    runs; None (no pinning) for all when there are fewer CPUs than replicas."""
    cpus = sorted(os.sched_getaffinity(0))
    if num_replicas == 1 or len(cpus) < num_replicas:
        return [None] * num_replicas
    share = len(cpus) // num_replicas
    return [set(cpus[i * share : (i + 1) * share]) for i in range(num_replicas)]


class ReplicaSet:
    """The API process's handle on its engine cores: :class:`AsyncEngine`'s interface over
    ``num_replicas`` of them."""

    def __init__(
        self,
        engine_options: dict,
        num_replicas: int = 1,
        routing: str = "prefix",
        on_death: Callable[[str], None] | None = None,
        step_timeout: float | None = None,
    ):
        """``step_timeout``: seconds a core may go without progress while it has requests in
        flight before it counts as dead (``--engine-step-timeout``; None: never)."""
        if num_replicas < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {num_replicas}")
        self.routing = routing
        self.events = KVEventsConfig.from_dict(engine_options.get("kv_events_config"))
        self._feeds: list[asyncio.Task] = []
        self.replicas = [
            AsyncEngine(engine_options, self._one_died, cpus=cpus, rank=rank, step_timeout=step_timeout)
            for rank, cpus in enumerate(core_shares(num_replicas))
        ]
        self.on_death = on_death
        self.router: Router | None = None
        self._death_reported = False

    @property
    def ready(self):
        return self.replicas[0].ready

    @property
    def dead(self) -> str | None:
        return next((replica.dead for replica in self.replicas if replica.dead), None)

    def unresponsive(self, limit: float) -> str | None:
        """Why a core with requests in flight shows no progress within ``limit`` seconds (the
        first such core, named when there are several), or None."""
        for rank, replica in enumerate(self.replicas):
            problem = replica.unresponsive(limit)
            if problem:
                return problem if len(self.replicas) == 1 else f"data-parallel core {rank}: {problem}"
        return None

    def add_stats_listener(self, make_listener: Callable[[int], Callable[[EngineStats], None]]) -> None:
        """``make_listener(i)`` is called once per replica; what it returns gets replica i's stats."""
        for index, replica in enumerate(self.replicas):
            replica.stats_listeners.append(make_listener(index))

    def launch(self) -> None:
        """Spawn every core now, so that they load while the API process does its own start-up;
        :meth:`start` then waits for them."""
        for replica in self.replicas:
            replica.launch()

    def abandon(self) -> None:
        """Kill the launched cores of a server that failed before it started."""
        for replica in self.replicas:
            replica.abandon()

    async def start(self):
        readies = await asyncio.gather(
            *(replica.start() for replica in self.replicas), return_exceptions=True
        )
        failed = next((r for r in readies if isinstance(r, BaseException)), None)
        if failed is not None:
            await self.shutdown()
            raise failed
        info = readies[0].cache_info
        self.router = Router(
            self.routing,
            len(self.replicas),
            int(info.get("block_size", 16)),
            int(info.get("num_gpu_blocks", 0)),
        )
        self._follow_kv_events()
        return readies[0]

    def _follow_kv_events(self) -> None:
        """With KV events published where this machine can subscribe, the prefix router follows
        each core's events."""
        events = self.events
        if len(self.replicas) == 1 or self.routing != "prefix" or events is None or not events.publishing:
            return
        if kv_events.subscriber_endpoint(events.endpoint, 0) is None:
            return
        self._events_context = zmq.asyncio.Context()
        self._feeds = [
            asyncio.create_task(
                kv_events.follow(
                    self._events_context, events, rank, functools.partial(self.router.observe, rank)
                )
            )
            for rank in range(len(self.replicas))
        ]

    def submit(
        self,
        children,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
        lora_request: LoRARequest | None = None,
        mm_items: tuple[MultiModalItem, ...] = (),
    ) -> RequestHandle:
        loads = [replica.open_requests for replica in self.replicas]
        prompt = children[0][1]
        index = self.router.choose(prompt, loads, cache_salt, mm_items) if len(self.replicas) > 1 else 0
        replica = self.replicas[index]
        return replica.submit(children, priority, cache_salt, kv_transfer_params, lora_request, mm_items)

    def abort(self, request_ids) -> None:
        request_ids = list(request_ids)
        for replica in self.replicas:
            replica.abort([rid for rid in request_ids if replica.routes(rid)])

    async def control(self, method: str, **arguments) -> list:
        """Call a control method on every engine core (:meth:`AsyncEngine.control`); their results."""
        calls = (replica.control(method, **arguments) for replica in self.replicas)
        return list(await asyncio.gather(*calls))

    def cut_open_requests(self) -> int:
        return sum(replica.cut_open_requests() for replica in self.replicas)

    async def shutdown(self) -> None:
        for feed in self._feeds:
            feed.cancel()
        await asyncio.gather(*self._feeds, return_exceptions=True)
        if self._feeds:
            self._events_context.destroy(linger=0)
        await asyncio.gather(*(replica.shutdown() for replica in self.replicas))

    def _one_died(self, reason: str) -> None:
        """A replica died: the others' requests fail too, and the server goes down."""
        if self._death_reported:
            return
        self._death_reported = True
        for replica in self.replicas:
            if not replica.dead:
                replica.fail(f"another data-parallel replica died: {reason}")
        if self.on_death is not None:
            self.on_death(reason)
