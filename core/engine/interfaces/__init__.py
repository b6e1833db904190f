"""Extension interfaces, one module per kind, and every type a plugin's code meets: the
context objects constructors receive, the request a scheduler, KV connector or logits
processor is handed, and the scheduler's step messages. Plugins import from here (and
``engine``, ``engine.layers``, ``engine.runner.drafting``, ``engine.testing``), never deeper."""

from engine.distributed import Communicator, ExecutorFailure
from engine.interfaces.attention import (
    KV_CACHE_DTYPES,
    PAGED_KV,
    PAGED_LATENT,
    AttentionBackend,
    AttentionSpec,
    BatchLayout,
    KVScale,
    LatentUpProjection,
    PagedLatent,
    dequantize_kv,
    head_layout_reasons,
    quantize_kv,
)
from engine.interfaces.drafter import Draft, Drafter, DrafterContext, DraftRequest
from engine.interfaces.executor import Executor, ExecutorContext
from engine.interfaces.grammar import Grammar, GrammarBackend, GrammarContext, GrammarSpec
from engine.interfaces.kv_cache import KVCacheGroup, KVCacheManager
from engine.interfaces.kv_connector import (
    SCHEDULER_ROLE,
    WORKER_ROLE,
    KVConnector,
    KVConnectorContext,
    KVRequest,
    KVTransferReport,
)
from engine.interfaces.loader import ModelLoader
from engine.interfaces.logits_processor import LogitsProcessor
from engine.interfaces.lora_resolver import LoRAResolver, LoRAResolverContext
from engine.interfaces.model import (
    FALLBACK_ARCHITECTURE,
    AttentionKind,
    KVLayout,
    MambaState,
    Model,
    ModelContext,
    MultiModalProcessor,
    ProcessedImage,
    StepContext,
)
from engine.interfaces.platform import Platform, StepGraphs
from engine.interfaces.quant import QuantContext, QuantMethod
from engine.interfaces.reasoning_parser import ReasoningMarkers, ReasoningParser
from engine.interfaces.scheduler import KVAdmission, PrefixHit, Scheduler, SchedulerContext, SchedulerStats
from engine.interfaces.tool_parser import (
    ArgumentsDelta,
    CallPieces,
    MarkedToolParser,
    ToolCall,
    ToolParser,
    join_calls,
    marker_tail,
)
from engine.messages.request import Request, RequestStatus
from engine.messages.step import (
    EngineOutput,
    Overloaded,
    ScheduledRequest,
    StepPlan,
    StepResult,
    TokenLogprobs,
)

# Interface version per kind. Bump a kind's number when its contract changes
# incompatibly; plugins declare the version they target with ``api=`` when registering.
INTERFACE_VERSIONS = {
    # 2: step_graphs (defaulted: v1 platforms still load)
    # 3: LayerOps.pack_dense's matmul is F.linear's within float32 summation order, no longer its
    #    bits (a platform may widen bfloat16 weights to float32 as it reads them); v1 and v2
    #    platforms still load (their exact results are within it)
    "platforms": 3,
    # 2: cuda_graph_support, describe; 3: build_graph_metadata (all defaulted: v1 and v2 still load)
    # 4: AttentionSpec's sliding_window, logit_softcap, query_scale and causal=False are part of the
    #    contract (older backends still load and are never handed a spec that sets one); constructed
    #    with registry= (the engine's plugins)
    # 5: cache layouts — AttentionSpec.latent (the paged latent layout, MLA), cache_layouts,
    #    forward_latent (v4 backends still load, declare per-head K/V only, and are never handed a
    #    latent spec)
    # 6: attention sinks — AttentionSpec.sinks, forward(..., sinks=) (gpt-oss); v1-v5 backends still
    #    load and are never handed a spec with sinks
    "attention_backends": 6,
    # 2: the engine.layers of this release — RotaryEmbedding(positions) returns the cos/sin tables and
    #    LayerOps.rotary_qkv rotates, silu_and_mul is a LayerOps method — and StepContext.kv_connector
    #    (a model attending without engine.layers.Attention calls the connector's per-layer hooks).
    #    v1 models, built on the release-1 layers, are refused
    # 3: per-layer cache layouts — AttentionKind.latent declares a layer's paged latent cache (MLA),
    #    attended through engine.layers.LatentAttention (additive: v2 models still load)
    # 4: fixed-size per-request state — AttentionKind.state declares a Mamba2 layer's conv + SSM
    #    state (MambaState), one slot per running request; LayerOps.causal_conv1d / ssm_scan
    #    — and AttentionKind.sinks, a layer's learned per-head sink logits handed to
    #    engine.layers.Attention as sinks= (additive: v2 and v3 models still load)
    # 5: several position axes per token — Model.position_axes and prompt_positions (M-RoPE:
    #    Qwen2-VL); forward's positions are then [axes, T]; MultiModalProcessor(...,
    #    processor_kwargs=) for --mm-processor-kwargs; Model.num_labels and classify(pooled) for
    #    sequence classifiers (the pooling runner's classify task) (additive: v2-v4 models still load)
    # 6: Model.mtp_architecture(hf_config) names the checkpoint's multi-token-prediction module, a
    #    registered architecture (drafter_only) an MTP drafter builds from the same checkpoint (additive)
    "models": 6,
    "model_loaders": 3,  # 2: iter_weights(keep_quantized=...); 3: iter_weight_slices(keep_quantized=...)
    # 2: dequantize (required), embed, describe, quantizes_embeddings; 3: tensor-parallel
    # sharding of packed and kept-quantized weights (Linear.full_row_max, rank parts in the
    # loader's kept-quantized form): v2 methods still load and never shard (the v2 default)
    # 4: checkpoint_tensor_name (tensors named below a weight, bitsandbytes'; defaulted: v2 and
    #    v3 methods still load)
    # 5: planned_kernel (what a layer fed through sinks holds once loaded, for --dry-run's plan;
    #    defaulted: v2-v4 methods still load and are planned at their registered tensors)
    # 6: splits_experts / experts_whole_because (FusedMoE split by intermediate slice under tensor
    #    parallelism; defaulted: v2-v5 methods still load and keep whole experts on every rank)
    "quant_methods": 6,
    # 2: two halves joined by build_connector_meta / bind_connector_metadata, KVRequest (block
    # hashes, salt), async and failed loads, per-layer hooks inside the forward, KVTransferReport
    # 3: KVRequest.kv_transfer_params / finish_reason, request_finished -> (delay, params),
    #    KVConnectorContext.engine_id / kv_ip / kv_port, shutdown (all defaulted: v2 still loads)
    # 4: reset_cache (forget the stored blocks: a weight update; defaulted: v2 and v3 still load,
    #    and are refused sleep mode and weight updates)
    "kv_connectors": 4,
    # 2: the semantics a backend must honour are the contract (EOS allowed where the output may
    #    end, is_terminated exactly once EOS is accepted, rows start all-allowed and span the
    #    model's vocabulary, json_object is an object): v1 backends, written to vaguer docs, are
    #    refused (a v1 backend cannot be told apart from one that cuts "deep blue sea" to "deep")
    # 3: the structural_tag kind (xgrammar's structural tags: free text, tags with JSON inside);
    #    v2 backends still load and are never handed one
    "grammar_backends": 3,
    # 2: DrafterContext.load_model(path, architecture=): a named architecture, from the target's own
    #    checkpoint when path is None (an MTP module) (additive: v1 drafters still load)
    # 3: Drafter.drafts_on_every_rank and DrafterContext.share: a drafter that calls the target's
    #    sharded layers runs on every tensor-parallel rank (defaulted: v1 and v2 still load, and
    #    draft on rank 0 alone)
    "drafters": 3,
    "logits_processors": 1,
    # 2: update_kv_transfers(KVTransferReport) replaces free_finished_transfers
    # 3: policy only — the core applies results and runs the KV connector's request protocol
    #    (SchedulerContext.kv_admission, typed SchedulerStats, reserve_lookahead, step_done); v2
    #    schedulers still load and run through engine.core.scheduler_v2
    "schedulers": 3,
    # 2: allocate_slots(delay_cache=...); 3: state groups (KVCacheGroup.state, supports_state: one
    # slot per request, never prefix-cached); a v2 manager still loads and is never handed one
    "kv_cache_managers": 3,
    # 2: use_tools (defaulted: v1 still loads); 3: streamed calls — feed/finish may give
    #    ArgumentsDelta pieces after a call's ToolCall (MarkedToolParser.partial_calls); v1 and v2
    #    parsers, which give whole calls, still load
    "tool_parsers": 3,
    "reasoning_parsers": 2,  # 2: grammar_markers (defaulted: v1 still loads, its grammar spans the output)
    "commands": 1,
    # 2: drafter_call and share, for a drafter that drafts on every rank (defaulted as one rank
    #    runs them: v1 still loads; DriverExecutor, the multi-rank base, implements them)
    # 3: sleep_mode_call, sleep mode and weight updates on every rank (defaulted as one rank runs
    #    it: v1 and v2 still load; a multi-rank one that keeps the default is refused them)
    "executors": 3,
    "lora_resolvers": 1,
}

# Older versions a kind still loads: the newer one only added members with defaults, or (schedulers v2)
# the core adapts the old contract exactly.
STILL_LOADED = {
    "attention_backends": (1, 2, 3, 4, 5),
    "models": (2, 3, 4, 5),
    "drafters": (1, 2),
    "executors": (1, 2),
    "kv_cache_managers": (2,),
    "platforms": (1, 2),
    "model_loaders": (2,),
    "quant_methods": (2, 3, 4, 5),
    "kv_connectors": (2, 3),
    "schedulers": (2,),
    "grammar_backends": (2,),
    "reasoning_parsers": (1,),
    "tool_parsers": (1, 2),
}

# Loaded older versions in their one release of deprecation warnings: kind -> {version: the release
# that stops loading it}. Registering for one logs a warning naming that release, and ``engine plugins``
# marks it, so that an author hears of the drop a whole release before it ("Interface versions" in
# the plugin authors' guide). Schedulers v2: v3 is another contract, not a superset, so v2 runs
# through an adapter (engine.core.scheduler_v2) and a context field (kv_connector) kept for it alone.
DEPRECATED: dict[str, dict[int, str]] = {
    "schedulers": {2: "release 3"},
}

__all__ = [
    "FALLBACK_ARCHITECTURE",
    "INTERFACE_VERSIONS",
    "KV_CACHE_DTYPES",
    "PAGED_KV",
    "PAGED_LATENT",
    "SCHEDULER_ROLE",
    "WORKER_ROLE",
    "ArgumentsDelta",
    "AttentionBackend",
    "AttentionKind",
    "AttentionSpec",
    "BatchLayout",
    "CallPieces",
    "Communicator",
    "Draft",
    "DraftRequest",
    "Drafter",
    "DrafterContext",
    "EngineOutput",
    "Executor",
    "ExecutorContext",
    "ExecutorFailure",
    "Grammar",
    "GrammarBackend",
    "GrammarContext",
    "GrammarSpec",
    "KVAdmission",
    "KVCacheGroup",
    "KVCacheManager",
    "KVConnector",
    "KVConnectorContext",
    "KVLayout",
    "KVRequest",
    "KVScale",
    "KVTransferReport",
    "LatentUpProjection",
    "LoRAResolver",
    "LoRAResolverContext",
    "LogitsProcessor",
    "MambaState",
    "MarkedToolParser",
    "Model",
    "ModelContext",
    "ModelLoader",
    "MultiModalProcessor",
    "Overloaded",
    "PagedLatent",
    "Platform",
    "PrefixHit",
    "ProcessedImage",
    "QuantContext",
    "QuantMethod",
    "ReasoningMarkers",
    "ReasoningParser",
    "Request",
    "RequestStatus",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerContext",
    "SchedulerStats",
    "StepContext",
    "StepGraphs",
    "StepPlan",
    "StepResult",
    "TokenLogprobs",
    "ToolCall",
    "ToolParser",
    "dequantize_kv",
    "head_layout_reasons",
    "join_calls",
    "marker_tail",
    "quantize_kv",
]
