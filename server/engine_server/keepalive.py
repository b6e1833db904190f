"""Keep-alive for streams: a stream that waits long for its next token sends an SSE comment
(``--stream-keepalive-interval``), so a proxy does not close the idle connection and a client
sees that the server is there. Clients skip comment lines (the SSE format; the ``openai``
client does).

A stream reads its engine deltas as ``handle.deltas(quiet_after=interval)``, which gives
:data:`QUIET` each time the interval passes without one: the wait is timed inside the request
handle, around its queue, so the read in progress survives it (a timeout around the generator
itself would end it for good) and a delta already queued is taken without a wait."""

KEEPALIVE_FRAME = ": keep-alive\n\n"

QUIET = None  # what ``RequestHandle.deltas(quiet_after=...)`` gives when the interval passed with no delta
