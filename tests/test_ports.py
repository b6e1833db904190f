"""engine.testing.ports: the ports tests start servers on stay clear of outgoing connections."""

import socket

from engine.testing.ports import EPHEMERAL, LOWEST, free_port


def test_a_span_of_free_ports_below_the_ephemeral_range_never_handed_out_twice():
    firsts = [free_port(span=2) for _ in range(50)]
    handed = [p for first in firsts for p in (first, first + 1)]
    assert len(set(handed)) == len(handed)
    assert all(LOWEST <= p < EPHEMERAL for p in handed)
    for port in handed[:10]:
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))
