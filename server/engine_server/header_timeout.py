"""A deadline on a request's headers, against slowloris.

uvicorn bounds the idle time between requests (keep-alive) but not headers that trickle in: a
client sending one header byte a minute holds a connection and its buffers for as long as it
likes, and a few thousand such clients exhaust the server's file descriptors. The request body
has its own deadline (:func:`engine_server.validation.read_body`); this one covers the head.

The deadline is armed when a connection opens and again when a response completes (the next
request's headers are then awaited), and disarmed as soon as the protocol starts a request
cycle. On expiry the client gets a 408 and the connection is closed. It wraps uvicorn's HTTP
protocol class, which :class:`uvicorn.Config` takes as ``http=``; both of uvicorn's protocols
(h11 and httptools) keep the request in flight as ``cycle`` and call ``on_response_complete``.
"""

from __future__ import annotations

import asyncio
import json
import logging

from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

from engine_server.errors import APIError

logger = logging.getLogger(__name__)


def _timeout_response() -> bytes:
    """An OpenAI-shaped 408, written raw: the request was never parsed, so no app answers it."""
    error = APIError(408, "the request headers did not arrive in time", code="header_timeout")
    body = json.dumps(error.body()).encode()
    head = "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    return f"{head}content-length: {len(body)}\r\n\r\n".encode() + body


TIMEOUT_RESPONSE = _timeout_response()


def with_header_timeout(seconds: float, http: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's ``http`` protocol class, closing connections whose request headers take more
    than ``seconds`` to arrive."""
    base = import_from_string(HTTP_PROTOCOLS[http])

    class HeaderDeadline(base):  # type: ignore[misc, valid-type]
        _deadline: asyncio.TimerHandle | None = None
        _waiting_after = None  # the request cycle that was current when the deadline was armed

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not self._waiting_after:  # a request's headers are complete
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.cycle is None or self.cycle.response_complete:  # else a pipelined one began
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._waiting_after = self.cycle
            self._deadline = asyncio.get_running_loop().call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if self.cycle is not self._waiting_after or self.transport.is_closing():
                return
            logger.info("closing a connection whose request headers took over %gs", seconds)
            self.transport.write(TIMEOUT_RESPONSE)
            self.transport.close()

    return HeaderDeadline
