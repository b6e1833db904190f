"""Planted bugs in a P/D connector: the p2p connector (``plugins/kvconnectors/p2p``) with one
mistake each in its transport, the part a P/D connector plugin writes. Registered, with the
correct connector, only in the child pytest of ``tests/test_kv_connector_kit_mutations.py``."""

from __future__ import annotations

from engine import hookimpl
from engine_kvconnectors_p2p.connector import P2pConnector
from engine_kvconnectors_p2p.transport import ZmqTransport


class SilentRelease(ZmqTransport):
    """Leaves ``release`` out, since the producer's abort timeout frees the blocks anyway: a
    prefill instance holds every prompt's blocks for the whole timeout."""

    def release(self, peer, remote_request_id):
        pass


class SilentReleaseConnector(P2pConnector):
    transport_class = SilentRelease


CORRECT = {"p2p-correct": P2pConnector}
MUTANTS = {"silent-release": SilentReleaseConnector}


@hookimpl
def register_kv_connectors(register):
    for name, connector in {**CORRECT, **MUTANTS}.items():
        register(name, connector, api=3)
