"""KVConnector (interface v4; v2 and v3 connectors still load): moves KV cache blocks to and from
outside the engine (a host or disk tier, another instance).

A connector class is instantiated twice, once per half (``KVConnectorContext.role``): the
**scheduler half** decides how many prompt tokens come from outside and describes each step's
transfers in a plain picklable value (:meth:`KVConnector.build_connector_meta`); the **worker
half** receives that value (:meth:`KVConnector.bind_connector_metadata`), moves the bytes during
the step and reports back (:meth:`KVConnector.get_finished`, a :class:`KVTransferReport`). The two
halves share nothing but these values, so they could live in different processes.

Call order each engine step (see ``docs/plugin-authors.md`` for the request state diagram)::

    scheduler half, while scheduling:
        get_num_new_matched_tokens(request, num_local)      per waiting request admitted
        update_state_after_alloc(request, blocks, local, n)  it got its blocks
        allocation_failed(request)                            ... or the pool could not give them
        request_finished(request, block_ids)                  a request finished (-> delay free,
                                                              kv_transfer_params for its output)
    scheduler half, after scheduling:  meta = build_connector_meta(plan)
    worker half:  bind_connector_metadata(meta); start_load_kv()
                  per layer inside the forward: wait_for_layer_load(layer), attention writes,
                  save_kv_layer(layer, kv_cache, slot_mapping)
                  wait_for_save(); clear_connector_metadata(); report = get_finished()
    scheduler half:  update_connector_output(report)

A step with nothing to compute still runs the worker half (without a forward: every layer's
``wait_for_layer_load`` is called in turn) so that asynchronous loads and saves progress; while a
delayed free is pending the engine keeps stepping (a few milliseconds apart) even without requests.

v3 (additive; v2 connectors still load): ``KVRequest.kv_transfer_params`` (the request's
``kv_transfer_params``, vLLM's P/D field) and ``KVRequest.finish_reason``; ``request_finished``
may return ``(delay_free, kv_transfer_params)``, the params going out with the request's last
output; ``KVConnectorContext.engine_id`` / ``kv_ip`` / ``kv_port`` from ``--kv-transfer-config``;
``shutdown``.

v4 (additive; v2 and v3 connectors still load): ``reset_cache``, which a connector implements to
forget what it stores when the weights change (sleep mode and weight updates need it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import attrs
import torch

SCHEDULER_ROLE = "scheduler"
WORKER_ROLE = "worker"


@attrs.frozen
class KVConnectorContext:
    """What a connector half is constructed with. ``kv_role`` and ``extra_config`` come from
    ``--kv-transfer-config`` (``kv_role``, ``kv_connector_extra_config``)."""

    config: Any  # engine.config.EngineConfig
    role: str  # SCHEDULER_ROLE or WORKER_ROLE
    block_size: int  # tokens per block
    num_layers: int  # KV cache tensors (one per layer)
    block_bytes: int  # bytes one block holds across all layers
    kv_role: str = "kv_both"  # kv_producer, kv_consumer or kv_both
    extra_config: dict = attrs.Factory(dict)
    engine_id: str = ""  # this engine's id among instances (kv_transfer_config.engine_id, else a fresh uuid)
    kv_ip: str = "127.0.0.1"  # where a connector that serves other instances listens (kv_ip, kv_port)
    kv_port: int = 14579


@attrs.frozen
class KVRequest:
    """The scheduler half's view of a request. ``block_hashes[i]`` is the chained hash of full
    block ``i`` (it covers every token before it, the ``cache_salt`` and the LoRA adapter, so equal
    hashes mean equal prefixes under equal salts and adapters); a connector keys stored blocks by
    it and need not re-hash."""

    request_id: str
    token_ids: tuple[int, ...]  # the prompt and the tokens generated so far
    num_prompt_tokens: int
    block_hashes: tuple[bytes, ...]  # every full block of ``token_ids``
    cache_salt: str | None = None
    num_computed_tokens: int = 0  # tokens whose K/V are in its blocks (a finished request: what to save)
    kv_transfer_params: dict | None = attrs.field(default=None, eq=False)  # as the client sent them (v3)
    finish_reason: str | None = None  # a finished request's: "stop", "length", "abort", "error" (v3)

    @classmethod
    def of(cls, request) -> KVRequest:
        """The view of an engine request (its ``block_hashes`` as the KV cache manager left them)."""
        return cls(
            request.request_id,
            tuple(request.all_token_ids),
            request.num_prompt_tokens,
            tuple(request.block_hashes),
            request.cache_salt,
            request.num_computed_tokens,
            request.kv_transfer_params,
            request.finish_reason,
        )


@attrs.frozen
class KVTransferReport:
    """The worker half's account of one step. ``failed_blocks``: block ids whose load failed
    (their requests recompute from the last block before the first failed one): a synchronous
    load's in the step it ran, an asynchronous load's in the report that lists its request in
    ``finished_loading`` (which it does whether the load succeeded or not). ``loaded_bytes`` and
    ``load_seconds``: what the loads of this step moved and how long they took."""

    finished_sending: frozenset[str] = frozenset()  # delayed frees that may now happen
    finished_loading: frozenset[str] = frozenset()  # asynchronous loads now complete
    failed_blocks: frozenset[int] = frozenset()
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    saved_bytes: int = 0


class KVConnector(ABC):
    def __init__(self, ctx: KVConnectorContext):
        self.ctx = ctx

    # -- scheduler half ---------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, request: KVRequest, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens beyond the ``num_computed_tokens`` found locally, a block multiple, that can be
        loaded from outside instead of computed; whether they load asynchronously). An
        asynchronous load parks the request (``WAITING_FOR_KV``) without blocking the queue until
        the worker half lists it in ``finished_loading``. The engine may take fewer tokens than
        offered (the last prompt token is always computed); ``update_state_after_alloc`` says how many."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: KVRequest, block_ids: list[int], num_local_tokens: int, num_external_tokens: int
    ) -> None:
        """The request got ``block_ids`` (its whole table): the first ``num_local_tokens`` came
        from the engine's prefix cache, the next ``num_external_tokens`` (maybe 0) are to be loaded
        by this step's worker half (blocks ``num_local_tokens // block_size`` onwards)."""

    def allocation_failed(self, request: KVRequest) -> None:
        """The pool could not give the request its blocks after ``get_num_new_matched_tokens``;
        it stays waiting and will be asked again. Drop anything reserved for it."""

    @abstractmethod
    def build_connector_meta(self, plan) -> object:
        """This step's transfers for the worker half, as a plain picklable value (called once
        per step after scheduling, with the :class:`engine.interfaces.StepPlan`; it should reset
        what it accumulated)."""

    def request_finished(self, request: KVRequest, block_ids: list[int]) -> bool | tuple[bool, dict | None]:
        """A request finished with this block table. True delays freeing its blocks until the
        worker half lists it in ``finished_sending`` (the blocks are not reused meanwhile);
        False frees them now: they stay intact until the next step's forward, so saves this
        step's metadata orders are taken before anything overwrites them. v3: a tuple
        ``(delay_free, kv_transfer_params)`` also hands the request's last output those params
        (a prefill instance's: where a decode instance finds its blocks), vLLM's signature."""
        return False

    def update_connector_output(self, report: KVTransferReport) -> None:
        """The worker half's report of the step (e.g. forget blocks whose load failed)."""

    def shutdown(self) -> None:
        """The engine is stopping (either half, v3): stop threads, close sockets."""

    def reset_cache(self) -> bool | None:
        """(v4, scheduler half; vLLM's) Forget every block stored outside the engine, so none is
        offered again: the engine calls it when a weight update makes them stale. True once
        forgotten (evictions the worker half carries out may follow in the next step's metadata);
        False if it cannot now. A connector that keeps this default (None) is refused sleep mode
        and weight updates: a P/D connector's blocks go to a peer whose weights the engine does
        not change. Sleeping alone (weights restored as they were) keeps the stored blocks."""
        return None

    # -- worker half ------------------------------------------------------------------
    @abstractmethod
    def register_kv_caches(self, kv_caches: list[torch.Tensor], block_dim: int) -> None:
        """One cache tensor per layer, in the attention backend's layout; ``block_dim`` is
        the dimension that indexes blocks (``index_select(block_dim, ids)`` takes blocks)."""

    @abstractmethod
    def bind_connector_metadata(self, meta: object) -> None:
        """This step's value from the scheduler half's ``build_connector_meta``."""

    def clear_connector_metadata(self) -> None:
        """The step is over."""

    @abstractmethod
    def start_load_kv(self) -> None:
        """Before the forward: start the step's loads (and any saves the metadata orders)."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Inside the forward, before ``layer``'s attention reads its cache: block until that
        layer's loads are in place."""

    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Inside the forward, after ``layer``'s attention wrote this step's K/V into ``kv_cache``
        at ``slot_mapping`` ([T] int64 slots, ``block * block_size + offset``, one per token)."""

    def wait_for_save(self) -> None:
        """After the forward: every save issued this step is done (or safely under way)."""

    def get_finished(self) -> KVTransferReport:
        """The step's report; a failed load is reported here, never raised."""
        return KVTransferReport()
