"""Keep-alive for streams: a stream that waits long for its next token sends an SSE comment
(``--stream-keepalive-interval``), so a proxy does not close the idle connection and a client
sees that the server is there. Clients skip comment lines (the SSE format; the ``openai``
client does)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

KEEPALIVE_FRAME = ": keep-alive\n\n"


class _Quiet:
    def __repr__(self) -> str:
        return "QUIET"


QUIET = _Quiet()  # what a Ticker gives when ``interval`` passed with no item
_END = object()


class Ticker:
    """The items of ``source``, and :data:`QUIET` each time ``interval`` seconds pass without
    one (never, with ``interval`` None). The read in progress survives a quiet interval:
    ``asyncio.wait_for`` would cancel it, which ends an async generator for good. Call
    :meth:`close` on every way out, or that read stays pending."""

    def __init__(self, source: AsyncIterator, interval: float | None):
        self._source, self.interval = source, interval
        self._pending: asyncio.Task | None = None

    def __aiter__(self) -> Ticker:
        return self

    async def __anext__(self):
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._read())
        done, _ = await asyncio.wait({self._pending}, timeout=self.interval)
        if not done:
            return QUIET
        task, self._pending = self._pending, None
        item = task.result()
        if item is _END:
            raise StopAsyncIteration
        return item

    async def _read(self):
        """The next item, or ``_END``: a task must not end in StopAsyncIteration."""
        try:
            return await anext(self._source)
        except StopAsyncIteration:
            return _END

    def close(self) -> None:
        """Cancel the read in progress; one that already ended has its error (a core that
        died) marked as seen, since nobody is left to read it."""
        task, self._pending = self._pending, None
        if task is None:
            return
        if not task.done():
            task.cancel()
        elif not task.cancelled():
            task.exception()
