"""Server: the prefill side of the side channel.

NIXL reads are one-sided: the decode instance reads the prefill instance's memory without the
prefill instance taking part, so nothing there would know a read is under way when its blocks are
freed. Hence leases: a decode instance asks before it reads (``lease``), the server grants a read
of blocks its request exposes, and the lease ends when the read's NIXL notification arrives, when
the reader releases the request, or after ``transfer_timeout`` (the reader gives up on a read by
then, so a lease never outlives the read it covers). ``withdraw`` waits for the request's leases to
end; no new one is granted after it. A lease asked for blocks not exposed yet waits up to
``transfer_timeout`` for them (the connector exposes a request's blocks one step after it handed
their params on).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, defaultdict

import attrs

from engine.kv_transfer import BlockLayout
from engine_kvconnectors_nixl import wire
from engine_kvconnectors_nixl.agent import Agent
from engine_kvconnectors_nixl.results import Results

logger = logging.getLogger(__name__)
REMEMBERED_WITHDRAWALS = 4096
PROBE_SECONDS = 0.1  # how often a reader whose leases a withdraw waits on is checked


@attrs.define
class _Lease:
    request_id: str
    reader: str  # the decode instance's NIXL agent
    deadline: float
    probed: float = 0.0  # when the reader was last found alive


@attrs.define
class _Parked:
    identity: bytes
    head: dict
    deadline: float


class Server:
    def __init__(self, router, ctx, agent: Agent, results: Results):
        self.router = router
        self.ctx = ctx
        self.agent = agent
        self.results = results
        hello = {
            "engine_id": ctx.engine_id,
            "agent": agent.name,
            "layout": ctx.layout.to_dict(),
            "regions": agent.regions.describe(),
        }
        self._hello = [wire.HELLO, wire.header(**hello), agent.metadata()]
        self.exposed: dict[str, frozenset[int]] = {}
        self.withdrawn: OrderedDict[str, None] = OrderedDict()
        self.leases: dict[str, _Lease] = {}  # lease id (the reader's) -> lease
        self.parked: list[_Parked] = []
        self.waiters: dict[str, list[threading.Event]] = defaultdict(list)

    @property
    def busy(self) -> bool:
        return bool(self.leases or self.parked)

    # -- the engine's orders -------------------------------------------------------------
    def expose(self, request_id: str, block_ids: list[int]) -> None:
        self.exposed[request_id] = frozenset(block_ids)
        self._serve_parked()

    def withdraw(self, request_id: str, done: threading.Event) -> None:
        self.exposed.pop(request_id, None)
        self.withdrawn[request_id] = None
        while len(self.withdrawn) > REMEMBERED_WITHDRAWALS:
            self.withdrawn.popitem(last=False)
        self._serve_parked()  # refuses the request's parked leases
        self.waiters[request_id].append(done)
        self._wake(request_id)

    # -- messages --------------------------------------------------------------------------
    def on_message(self, frames) -> None:
        try:
            if len(frames) < 3:
                raise ValueError(f"{len(frames)} frames")
            identity, kind, head = frames[0].bytes, frames[1].bytes, wire.parse(frames[2])
        except ValueError as exc:
            logger.warning("nixl: ignoring a side-channel message that is not one: %s", exc)
            return
        if head.get("engine_id") != self.ctx.engine_id:
            if kind != wire.RELEASE:  # a release for another instance: nothing of ours to free
                self._error(
                    identity,
                    str(head.get("id", wire.HELLO_ID)),
                    f"this instance's engine id is {self.ctx.engine_id!r}, not {head.get('engine_id')!r}",
                )
        elif kind == wire.HELLO:
            self._on_hello(identity, head, frames[3].bytes if len(frames) > 3 else b"")
        elif kind == wire.LEASE:
            self._lease(identity, head, time.monotonic() + self.ctx.transfer_timeout)
        elif kind == wire.RELEASE:
            request_id = str(head.get("request_id"))
            self.results.released(request_id)
            self._end_leases(request_id)

    def _on_hello(self, identity: bytes, head: dict, metadata: bytes) -> None:
        try:
            mismatch = self.ctx.layout.mismatch(BlockLayout.from_dict(head.get("layout") or {}))
        except ValueError as exc:
            mismatch = [str(exc)]
        if mismatch:
            reason = "the KV block layouts differ (prefill here, decode there): " + "; ".join(mismatch)
            logger.warning("nixl: refused decode instance %r: %s", head.get("agent"), reason)
            self._error(identity, wire.HELLO_ID, reason)
            return
        try:
            self.agent.load(str(head.get("agent")), metadata)  # to probe it while it holds leases
        except Exception as exc:  # noqa: BLE001 - NIXL refusing the metadata
            self._error(identity, wire.HELLO_ID, f"NIXL could not load agent {head.get('agent')!r}: {exc}")
            return
        self.router.send_multipart([identity, *self._hello])

    def on_notifications(self, messages: list[bytes]) -> None:
        """Reads complete (the reader's NIXL notification carries its lease id)."""
        for message in messages:
            lease = self.leases.pop(message.decode(errors="replace"), None)
            if lease is not None:
                self._wake(lease.request_id)

    # -- leases ------------------------------------------------------------------------------
    def _lease(self, identity: bytes, head: dict, deadline: float) -> bool:
        """Grant or refuse; False (parked) while the request's blocks are not exposed yet."""
        lease_id, request_id = str(head.get("id")), str(head.get("request_id"))
        try:
            wanted = wire.block_ids(head)
        except ValueError as exc:
            self._error(identity, lease_id, str(exc))
            return True
        exposed = self.exposed.get(request_id)
        if exposed is None and request_id not in self.withdrawn:
            self.parked.append(_Parked(identity, head, deadline))
            return False
        if exposed is None:
            self._error(
                identity,
                lease_id,
                f"request {request_id!r}'s blocks were freed (read already, or abort_request_timeout passed)",
            )
        elif not exposed.issuperset(wanted) or lease_id in self.leases:
            self._error(identity, lease_id, f"request {request_id!r} holds no blocks {wanted} to lease")
        else:
            now = time.monotonic()
            self.leases[lease_id] = _Lease(
                request_id, str(head.get("agent")), now + self.ctx.transfer_timeout, now
            )
            self.router.send_multipart([identity, wire.GRANT, wire.header(id=lease_id)])
        return True

    def _serve_parked(self) -> None:
        if self.parked:
            parked, self.parked = self.parked, []
            for p in parked:
                self._lease(p.identity, p.head, p.deadline)

    def _end_leases(self, request_id: str) -> None:
        for lease_id in [k for k, lease in self.leases.items() if lease.request_id == request_id]:
            del self.leases[lease_id]
        self._wake(request_id)

    def _wake(self, request_id: str) -> None:
        """Let ``withdraw`` return once none of the request's leases is left."""
        if request_id in self.waiters and all(
            lease.request_id != request_id for lease in self.leases.values()
        ):
            for event in self.waiters.pop(request_id):
                event.set()

    def tick(self, now: float) -> None:
        self._probe_readers(now)
        for p in [p for p in self.parked if p.deadline <= now]:
            self.parked.remove(p)
            self._error(
                p.identity,
                str(p.head.get("id")),
                f"request {p.head.get('request_id')!r} holds no "
                f"blocks here (not within {self.ctx.transfer_timeout:g} s)",
            )
        for lease_id, lease in [(k, v) for k, v in self.leases.items() if v.deadline <= now]:
            logger.warning(
                "nixl: a lease on request %s's KV blocks ran out (%g s, transfer_timeout) "
                "without its read completing",
                lease.request_id,
                self.ctx.transfer_timeout,
            )
            del self.leases[lease_id]
            self._wake(lease.request_id)

    def _probe_readers(self, now: float) -> None:
        """A withdraw waits on these leases: end those of a reader NIXL finds gone (a killed
        decode instance) instead of waiting out ``transfer_timeout`` with the engine blocked."""
        readers = {
            lease.reader
            for lease in self.leases.values()
            if lease.request_id in self.waiters and now - lease.probed >= PROBE_SECONDS
        }
        for reader in readers:
            held = {lease_id: lease for lease_id, lease in self.leases.items() if lease.reader == reader}
            if self.agent.alive(reader):
                for lease in held.values():
                    lease.probed = now
                continue
            logger.warning("nixl: decode agent %s is gone; its %d lease(s) end", reader, len(held))
            for lease_id, lease in held.items():
                del self.leases[lease_id]
                self._wake(lease.request_id)

    def _error(self, identity: bytes, lease_id: str, error: str) -> None:
        self.router.send_multipart([identity, wire.ERR, wire.header(id=lease_id, error=error)])

    def close(self) -> None:
        for events in self.waiters.values():
            for event in events:
                event.set()
        self.waiters.clear()
        self.router.close(linger=0)
