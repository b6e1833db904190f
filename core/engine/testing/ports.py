"""Ports for tests and benchmarks that start servers, publishers and transfer endpoints.

A port the kernel hands out (bind to port 0) lies in Linux's ephemeral range (32768 and up),
where any outgoing connection — a ZMQ or HTTP client, UCX's many sockets — may take it before
the server binds it; that failed CI twice. These ports come from below that range instead, are
checked free, and are never handed out twice by one process.
"""

from __future__ import annotations

import random
import socket

LOWEST, EPHEMERAL = 20000, 32768
_handed_out: set[int] = set()


def free_port(span: int = 1) -> int:
    """The first of `span` consecutive ports that were all free a moment ago (a server started
    with `-dp N` publishes KV events on port + rank, so it asks for a span of N)."""
    while True:
        first = random.randrange(LOWEST, EPHEMERAL - span)
        ports = range(first, first + span)
        if not _handed_out.intersection(ports) and all(map(_bindable, ports)):
            _handed_out.update(ports)
            return first


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
