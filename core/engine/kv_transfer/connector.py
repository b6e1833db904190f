"""PDConnector: prefill/decode disaggregation between engine instances, vLLM's flow, over any
:class:`~engine.kv_transfer.Transport`. A plugin subclasses it and names its transport::

    class P2pConnector(PDConnector):
        transport_class = ZmqTransport

Prefill instance (``kv_role`` kv_producer or kv_both): a request whose ``kv_transfer_params`` say
``do_remote_decode`` and that finishes by reaching ``max_tokens`` keeps its blocks (a delayed
free) and its output carries where they are (``remote_engine_id``, ``remote_request_id``,
``remote_block_ids``, ``remote_host``, ``remote_port``); its blocks are freed when the decode
instance says it is done with them, or after ``abort_request_timeout`` seconds.

Decode instance (kv_consumer or kv_both): a request with those params (``do_remote_prefill``)
reports the prompt tokens the prefill instance holds beyond its local prefix hit as loaded
asynchronously (it parks ``WAITING_FOR_KV``); the worker half pulls the blocks into its own
(other) block ids. A read that fails (dead prefill instance, timeout, layout mismatch) reports
its blocks failed: the request recomputes its prompt here and its output is unchanged.

``kv_connector_extra_config``: ``abort_request_timeout`` (seconds, default 480, vLLM's
``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``), ``transfer_timeout`` (seconds one read may take, default
30), and the transport's own ``EXTRA_KEYS``.
"""

from __future__ import annotations

from engine.interfaces import SCHEDULER_ROLE, KVConnector, KVTransferReport
from engine.kv_transfer.layout import BlockLayout
from engine.kv_transfer.scheduler_half import PRODUCING_ROLES, PDMeta, PDSchedulerHalf
from engine.kv_transfer.transport import Transport, TransportContext
from engine.kv_transfer.worker_half import PDWorkerHalf

DEFAULTS = {"abort_request_timeout": 480.0, "transfer_timeout": 30.0}


def _settings(ctx, transport_class: type[Transport]) -> dict[str, float]:
    extra = ctx.extra_config
    known = (*DEFAULTS, *transport_class.EXTRA_KEYS)
    unknown = sorted(set(extra) - set(known))
    if unknown:
        raise ValueError(f"kv_connector_extra_config: unknown key(s) {unknown}; known: {list(known)}")
    settings = {}
    for key, default in DEFAULTS.items():
        value = extra.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"kv_connector_extra_config.{key}: seconds > 0, got {value!r}")
        settings[key] = float(value)
    if ctx.kv_role in PRODUCING_ROLES and not ctx.kv_port:
        raise ValueError(
            "kv_transfer_config.kv_port: a prefill instance (kv_producer, kv_both) needs a fixed port "
            "(its responses tell decode instances where to read)"
        )
    return settings


class PDConnector(KVConnector):
    transport_class: type[Transport]  # set by the plugin's subclass

    def __init__(self, ctx):
        super().__init__(ctx)
        self.settings = _settings(ctx, self.transport_class)
        self.scheduler_half = PDSchedulerHalf(ctx) if ctx.role == SCHEDULER_ROLE else None
        self.worker_half: PDWorkerHalf | None = None  # once the caches are registered

    # -- scheduler half ---------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.scheduler_half.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, block_ids, num_local_tokens, num_external_tokens):
        self.scheduler_half.update_state_after_alloc(
            request, block_ids, num_local_tokens, num_external_tokens
        )

    def request_finished(self, request, block_ids):
        return self.scheduler_half.request_finished(request, block_ids)

    def build_connector_meta(self, plan) -> PDMeta:
        return self.scheduler_half.build_connector_meta()

    # -- worker half ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches, block_dim):
        ctx = self.ctx
        transport = self.transport_class(
            TransportContext(
                ctx.engine_id,
                ctx.kv_ip,
                ctx.kv_port,
                ctx.kv_role in PRODUCING_ROLES,
                BlockLayout.of(kv_caches, block_dim, ctx.block_size),
                self.settings["transfer_timeout"],
                dict(ctx.extra_config),
            )
        )
        transport.start(kv_caches, block_dim)
        self.worker_half = PDWorkerHalf(transport, self.settings["abort_request_timeout"])

    def bind_connector_metadata(self, meta):
        self.worker_half.bind(meta)

    def start_load_kv(self):
        self.worker_half.start()

    def get_finished(self) -> KVTransferReport:
        return self.worker_half.report()

    def shutdown(self):
        if self.worker_half is not None:
            self.worker_half.shutdown()
