"""The P/D connector's worker half: carries out the scheduler half's orders through the
transport, tells producers when their blocks may be freed, and frees this instance's held blocks
when their reader is done with them, or when ``abort_request_timeout`` passes without one (a
dead or never-coming decode instance must not hold a prefill instance's blocks forever)."""

from __future__ import annotations

import logging
import time

from engine.interfaces import KVTransferReport
from engine.kv_transfer.scheduler_half import PDMeta
from engine.kv_transfer.transport import Read, Transport

logger = logging.getLogger(__name__)


class PDWorkerHalf:
    def __init__(self, transport: Transport, abort_request_timeout: float):
        self.transport = transport
        self.abort_request_timeout = abort_request_timeout
        self._meta = PDMeta()
        self._reads: dict[str, Read] = {}  # this instance's requests pulling their blocks
        self._held: dict[str, float] = {}  # exposed request id -> when its blocks are freed unread
        # released before they were held (the reader was quicker than this instance's next step)
        self._early: dict[str, float] = {}  # request id -> when it is forgotten
        self._unread: list[str] = []  # held and released at once: reported sent in the next report

    def bind(self, meta: PDMeta) -> None:
        self._meta = meta

    def start(self) -> None:
        """The step's orders: expose what was held, start reads, send releases."""
        meta, self._meta = self._meta, PDMeta()
        deadline = time.monotonic() + self.abort_request_timeout
        for hold in meta.holds:
            if self._early.pop(hold.request_id, None) is not None:
                self._unread.append(hold.request_id)
                continue
            self.transport.expose(hold.request_id, list(hold.block_ids))
            self._held[hold.request_id] = deadline
        for read in meta.reads:
            self._reads[read.request_id] = read
            self.transport.read(read)
        for peer, remote_request_id in meta.releases:
            self.transport.release(peer, remote_request_id)

    def report(self) -> KVTransferReport:
        events = self.transport.poll()
        loaded, failed = set(), set()
        for request_id, ok in events.reads_done.items():
            read = self._reads.pop(request_id, None)
            if read is None:
                continue
            loaded.add(request_id)
            if not ok:
                failed.update(read.local_block_ids)
            self.transport.release(read.peer, read.remote_request_id)  # read or not, the producer may free
        return KVTransferReport(
            finished_sending=frozenset(self._sent(events.released)),
            finished_loading=frozenset(loaded),
            failed_blocks=frozenset(failed),
            loaded_bytes=events.loaded_bytes,
            load_seconds=events.load_seconds,
        )

    def _sent(self, released: frozenset[str]) -> list[str]:
        """Held requests whose reader is done, or whose time ran out, withdrawn from the transport."""
        now = time.monotonic()
        self._early = {rid: until for rid, until in self._early.items() if until > now}
        self._early.update(
            (rid, now + self.abort_request_timeout) for rid in released if rid not in self._held
        )
        expired = [rid for rid, deadline in self._held.items() if deadline <= now and rid not in released]
        for rid in expired:
            logger.warning(
                "request %s: no decode instance read its KV blocks within %g s "
                "(abort_request_timeout); freeing them",
                rid,
                self.abort_request_timeout,
            )
        done = [rid for rid in (*released, *expired) if rid in self._held]
        for rid in done:
            self.transport.withdraw(rid)
            del self._held[rid]
        done += self._unread
        self._unread = []
        return done

    def shutdown(self) -> None:
        self.transport.close()
