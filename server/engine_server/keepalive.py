"""Keep-alive for streams: a stream that waits long for its next token sends a blank SSE line
pair (``--stream-keepalive-interval``), so a proxy does not close the idle connection and a
client sees bytes arrive. An SSE client dispatches no event for it (the format's rule for an
empty event; the ``openai`` client follows it).

Why blank lines and not a comment (``: keep-alive``): vLLM's benchmark client (``vllm bench
serve``) strips each network read before it parses it, so a comment that arrives alone stays at
the head of its buffer and no frame after it is parsed (the request marked failed: 11 of 64 on a
machine whose prompts waited past the interval). Stripped, a blank pair is nothing; between two
frames of one read it splits off as an empty message.

A stream reads its engine deltas as ``handle.deltas(quiet_after=interval)``, which gives
:data:`QUIET` each time the interval passes without one: the wait is timed inside the request
handle, around its queue, so the read in progress survives it (a timeout around the generator
itself would end it for good) and a delta already queued is taken without a wait."""

KEEPALIVE_FRAME = "\n\n"

QUIET = None  # what ``RequestHandle.deltas(quiet_after=...)`` gives when the interval passed with no delta
