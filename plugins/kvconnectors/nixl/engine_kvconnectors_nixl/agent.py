"""Agent: this instance's NIXL agent, every NIXL call the transport makes.

The engine's KV caches are registered with NIXL once (``register_memory``, one region per layer)
and every block run of them prepared once as a local descriptor list; a peer's caches are
prepared likewise when its metadata arrives (``add_remote_agent``). A transfer then only names
descriptor indices (``make_prepped_xfer``), vLLM's way. Used from the transport thread only
(NIXL's default thread mode assumes one caller).
"""

from __future__ import annotations

import contextlib
import uuid

import torch

from engine_kvconnectors_nixl import nixl_api
from engine_kvconnectors_nixl.regions import Regions

LOCAL = "NIXL_INIT_AGENT"
DONE, PROC, ERR = "DONE", "PROC", "ERR"
PROBE = b"probe"  # a notification that only checks the peer is there


class Agent:
    def __init__(self, engine_id: str, backends: list[str], caches: list[torch.Tensor], regions: Regions):
        api = nixl_api.load()
        self.name = f"{engine_id}-{uuid.uuid4().hex[:8]}"  # a restarted instance is another agent
        self.regions = regions
        # no progress thread: NIXL's spins a core; the transport thread progresses UCX by polling
        # (every millisecond while a transfer or a lease is under way)
        config = api.nixl_agent_config(enable_prog_thread=False, backends=list(backends))
        self._nixl = api.nixl_agent(self.name, config)
        missing = [backend for backend in backends if backend not in self._nixl.backends]
        if missing:
            raise ValueError(
                f"kv_connector_extra_config.backends: NIXL could not start {missing} here "
                f"(its plugins: {sorted(self._nixl.get_plugin_list())})"
            )
        self._registered = self._nixl.register_memory(list(caches))
        self._local = self._nixl.prep_xfer_dlist(LOCAL, regions.descriptors(), regions.mem_type)
        self._loaded: set[str] = set()  # peer agents whose metadata is loaded
        self._peers: dict[str, tuple[object, Regions]] = {}  # agent name -> (prepared list, regions)

    def metadata(self) -> bytes:
        """What a peer loads to read from this agent."""
        return self._nixl.get_agent_metadata()

    def load(self, peer: str, metadata: bytes) -> None:
        """Load a peer agent's metadata (once: reading from it, or notifying it, needs it)."""
        if peer in self._loaded:
            return
        loaded = self._nixl.add_remote_agent(metadata)
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded != peer:
            raise ValueError(f"the metadata is agent {loaded!r}'s, not {peer!r}'s")
        self._loaded.add(peer)

    def prepare(self, peer: str, regions: Regions) -> None:
        """Prepare every block run of a loaded peer's caches for reads."""
        if peer not in self._peers:
            self._peers[peer] = (
                self._nixl.prep_xfer_dlist(peer, regions.descriptors(), regions.mem_type),
                regions,
            )

    def alive(self, peer: str) -> bool:
        """Whether a loaded peer is still there: a notification to it fails once UCX saw its
        connection drop (a killed process); a peer found gone is forgotten."""
        try:
            self._nixl.send_notif(peer, PROBE)
        except Exception:  # noqa: BLE001 - NIXL's disconnection error
            self.forget(peer)
            return False
        return True

    def forget(self, peer: str) -> None:
        prepared = self._peers.pop(peer, None)
        if prepared is not None:
            prepared[0].release()
        if peer in self._loaded:
            self._loaded.discard(peer)
            with contextlib.suppress(Exception):  # a peer already gone may refuse to be removed
                self._nixl.remove_remote_agent(peer)

    def read(self, peer: str, remote_blocks, local_blocks, notification: bytes):
        """Start reading the peer's blocks into ours, block i into block i; the peer receives
        ``notification`` once the read is complete. -> (handle, state)."""
        remote, regions = self._peers[peer]
        handle = self._nixl.make_prepped_xfer(
            "READ",
            self._local,
            self.regions.indices(local_blocks),
            remote,
            regions.indices(remote_blocks),
            notification,
        )
        return handle, self._nixl.transfer(handle)

    def state(self, handle) -> str:
        """DONE, PROC or ERR (a disconnected peer raises inside NIXL: ERR too)."""
        try:
            return self._nixl.check_xfer_state(handle)
        except Exception:  # noqa: BLE001 - NIXL reports a dead peer as an exception
            return ERR

    @staticmethod
    def release(handle) -> bool:
        """Free a transfer, cancelling it if it is under way; False when NIXL cannot (it still runs)."""
        try:
            handle.release()
        except Exception:  # noqa: BLE001 - NIXL's refusal to cancel
            return False
        return True

    def notifications(self) -> list[bytes]:
        """Notifications received since the last call, from any peer (probes left out)."""
        return [
            message
            for messages in self._nixl.get_new_notifs().values()
            for message in messages
            if message != PROBE
        ]

    def close(self) -> None:
        """Forget peers and deregister the caches; the agent goes with its last reference, so
        peers reading from it see a disconnection."""
        for prepared, _ in self._peers.values():
            prepared.release()
        self._peers.clear()
        self._local.release()
        self._local = None
        self._nixl.deregister_memory(self._registered)
        self._nixl = None
