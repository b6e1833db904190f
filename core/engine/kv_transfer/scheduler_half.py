"""The P/D connector's scheduler half: which requests pull their prompt blocks from a prefill
instance (decode side), which keep their blocks for a decode instance (prefill side), and the
per-step orders for the worker half (:class:`PDMeta`)."""

from __future__ import annotations

import logging
import socket
from collections import OrderedDict

import attrs

from engine.interfaces import KVRequest
from engine.kv_transfer.params import Peer, RemotePrefill, prefill_params, wants_remote_decode
from engine.kv_transfer.transport import Read

logger = logging.getLogger(__name__)

PRODUCING_ROLES = ("kv_producer", "kv_both")
CONSUMING_ROLES = ("kv_consumer", "kv_both")
_WILDCARDS = ("0.0.0.0", "::", "*", "")
REMEMBERED_PULLS = 65536


@attrs.frozen
class Hold:
    request_id: str
    block_ids: tuple[int, ...]


@attrs.frozen
class PDMeta:
    """One step's orders: blocks to serve (prefill side), reads to start and producers to tell
    they may free a request's blocks (decode side)."""

    holds: tuple[Hold, ...] = ()
    reads: tuple[Read, ...] = ()
    releases: tuple[tuple[Peer, str], ...] = ()  # (peer, its request id)


def advertised_host(kv_ip: str) -> str:
    """The host decode instances reach this one at: ``kv_ip``, or this machine's name when it
    listens on every interface."""
    return socket.gethostname() if kv_ip in _WILDCARDS else kv_ip


class PDSchedulerHalf:
    def __init__(self, ctx):
        self.block_size = ctx.block_size
        self.produces = ctx.kv_role in PRODUCING_ROLES
        self.consumes = ctx.kv_role in CONSUMING_ROLES
        self.me = Peer(ctx.engine_id, advertised_host(ctx.kv_ip), ctx.kv_port)
        self._remote: dict[str, RemotePrefill] = {}  # admitted later: pull at the first allocation
        self._pulled: OrderedDict[str, None] = OrderedDict()  # unfinished requests whose pull was ordered
        self._holds: list[Hold] = []
        self._reads: list[Read] = []
        self._releases: list[tuple[Peer, str]] = []

    def get_num_new_matched_tokens(self, request: KVRequest, num_computed_tokens: int) -> tuple[int, bool]:
        """The prompt tokens the prefill instance holds beyond the local hit, loaded
        asynchronously; asked only until the request's first allocation."""
        remote = self._pending(request)
        if remote is None:
            return 0, False
        held = min(len(remote.block_ids) * self.block_size, request.num_prompt_tokens)
        num = max(0, held - num_computed_tokens)
        return num, num > 0

    def _pending(self, request: KVRequest) -> RemotePrefill | None:
        if request.request_id in self._remote:
            return self._remote[request.request_id]
        if request.request_id in self._pulled:
            return None  # preempted after its pull was ordered: its prefix is local or recomputed
        remote = RemotePrefill.of(request.kv_transfer_params)
        if remote is None:
            return None
        refusal = self._refusal(request, remote)
        if refusal:
            logger.warning("request %s: %s; its prompt is computed here", request.request_id, refusal)
            self._releases.append((remote.peer, remote.request_id))
            self._pulled_add(request.request_id)
            return None
        self._remote[request.request_id] = remote
        return remote

    def _refusal(self, request: KVRequest, remote: RemotePrefill) -> str | None:
        if not self.consumes:
            return "it asks for a remote prefill, but this instance's kv_role does not consume"
        if not remote.matches(request.block_hashes, request.num_prompt_tokens, self.block_size):
            return "its prompt is not the one the prefill instance computed (remote_prompt_hash differs)"
        return None

    def _pulled_add(self, request_id: str) -> None:
        """Remember a request's pull was ordered. A request aborted while its pull runs is never
        finished through this half (the engine frees it when the load ends), so the record is
        bounded: an entry that falls out only lets a request preempted before its first token try
        its (released) blocks again, which fails and recomputes."""
        self._pulled[request_id] = None
        while len(self._pulled) > REMEMBERED_PULLS:
            self._pulled.popitem(last=False)

    def update_state_after_alloc(
        self, request: KVRequest, block_ids: list[int], num_local_tokens: int, num_external_tokens: int
    ) -> None:
        remote = self._remote.pop(request.request_id, None)
        if remote is None:
            return
        self._pulled_add(request.request_id)
        if not num_external_tokens:  # nothing worth pulling (a local hit, or under one block)
            self._releases.append((remote.peer, remote.request_id))
            return
        first, count = num_local_tokens // self.block_size, num_external_tokens // self.block_size
        self._reads.append(
            Read(
                request.request_id,
                remote.peer,
                remote.request_id,
                remote.block_ids[first : first + count],
                tuple(block_ids[first : first + count]),
            )
        )

    def request_finished(self, request: KVRequest, block_ids: list[int]) -> tuple[bool, dict | None]:
        remote = self._remote.pop(request.request_id, None)
        if remote is None and request.request_id not in self._pulled:
            remote = RemotePrefill.of(request.kv_transfer_params)  # never admitted
        self._pulled.pop(request.request_id, None)
        if remote is not None:  # finished before its pull started (aborted, refused): free the producer's
            self._releases.append((remote.peer, remote.request_id))
            return False, None
        if not (
            self.produces
            and wants_remote_decode(request.kv_transfer_params)
            and request.finish_reason == "length"
            and block_ids
        ):
            return False, None  # vLLM's rule: only a prefill that ran to max_tokens hands its blocks on
        prompt_blocks = tuple(block_ids[: -(-request.num_prompt_tokens // self.block_size)])
        self._holds.append(Hold(request.request_id, prompt_blocks))
        full = request.num_prompt_tokens // self.block_size
        last_full_hash = request.block_hashes[full - 1] if full else None
        return True, prefill_params(self.me, request.request_id, list(prompt_blocks), last_full_hash)

    def build_connector_meta(self) -> PDMeta:
        meta = PDMeta(tuple(self._holds), tuple(self._reads), tuple(self._releases))
        self._holds, self._reads, self._releases = [], [], []
        return meta
