"""Step graphs: decode steps recorded once per batch size and replayed (CUDA graphs on the cuda
platform, native tapes on cpu-native — whatever ``Platform.step_graphs`` gives).

At start-up the engine records the model's forward once per batch bucket (the platform's default
sizes up to ``max_num_seqs``, or ``cuda_graph_sizes``) over static input buffers (each bucket's
the first rows of the largest's) — a server's core in its first idle moments instead, one bucket
at a time between steps, so that it is ready sooner (a bucket not yet recorded runs eagerly); a
step whose requests all have one query row (a uniform decode step) is padded to the smallest
bucket that holds it (:func:`engine.runner.decode_inputs.pad_decode`: padding rows are token 0
at position 0, one key in the null block, their outputs dropped) and replayed; any other step
runs eagerly. This needs an attention backend declaring ``cuda_graph_support`` "decode-only" or
"full" (the metadata it builds with ``build_graph_metadata`` for the static buffers must stay
valid as they are overwritten). The recordings are made largest first;
:func:`graph_memory_estimate` is taken out of the KV cache budget before it is sized (an
estimate: the recording is not measured). Before the first replay serves a request, one replay
of random inputs is compared with the eager forward of the same inputs
(:meth:`StepGraphRunner.check`): a recording that does not reproduce it is dropped.
``enforce_eager`` turns all of this off, and it is off wherever :func:`graph_plan` gives a
reason.

A step whose rows all decode greedily (``StepInput.greedy``), of a bucket up to the platform's
``StepGraphs.greedy_sizes_up_to`` rows, replays a second recording of that bucket: the forward,
then the LM head and each row's first maximum (:func:`engine.runner.sampler.greedy_tokens`),
whose tokens are all the step needs, then the inputs moved on by those tokens
(``DecodeInputs.advance``). With them recorded, a greedy step's host work is one replay (the
head's module calls, argument checks and the sampler's path were a few per cent of a
single-stream token), and a burst of steps (``num_scheduler_steps``: ``StepPlan.decode_burst``)
is that replay repeated. Each such recording's tokens on random inputs are compared with the
eager ones before it serves (the scoring may take another path at another size), and one that
differs is dropped; a model whose greedy tokens cannot be recorded (a head that branches in
Python on its own results) keeps the forward's recording alone for that bucket. A bucket above
``StepGraphs.start_up_sizes_up_to`` gets its forward's recording from the first step that needs
it, and its greedy one from its :data:`GREEDY_AFTER_STEPS`-th greedy step in a row (earlier ones
replay the forward's).

LoRA adapters run inside the recordings: each bucket has a static row -> slot buffer that the
layers' LoRA ops read (:class:`engine.layers.lora.LoRABatch` points at it while recording), and a
replay copies the step's slots into it (-1, no adapter, for padding rows and for a step without
adapters). The slot weights are fixed buffers an adapter is copied into, so what a recording
addresses never moves.

CUDA graphs have not yet run on a GPU: their capture and replay are written to the CUDA graph
API as documented; the bucket choice, padding and reasons are tested on the CPU, where native
tapes run the same runner.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs
import torch

from engine.interfaces import BatchLayout, StepContext, StepGraphs
from engine.runner.decode_inputs import DecodeInputs
from engine.runner.sampler import greedy_tokens

logger = logging.getLogger(__name__)


# greedy steps of one size in a row before a size above the start-up sizes gets its greedy
# recording (until then its steps replay the forward's): a batch shrinking through a size in a
# step or two never pays for the recording and its check (a first round through 56 sizes took
# 4.23 s with them against 3.67 s)
GREEDY_AFTER_STEPS = 4


def greedy_sizes(graphs: StepGraphs, sizes: Sequence[int]) -> list[int]:
    """Those of ``sizes`` that also get a greedy recording (``graphs.greedy_sizes_up_to``)."""
    limit = graphs.greedy_sizes_up_to
    return [s for s in sizes if limit is None or s <= limit]


def capture_sizes(
    configured: Sequence[int] | None, defaults: Sequence[int], max_num_seqs: int
) -> tuple[int, ...]:
    """The buckets to record: ``configured`` (sorted, deduplicated, those above
    ``max_num_seqs`` dropped) or the platform's ``defaults``."""
    if configured is None:
        return tuple(defaults)
    if any(s < 1 for s in configured):
        raise ValueError(f"cuda_graph_sizes: batch sizes must be positive, got {list(configured)}")
    return tuple(sorted({s for s in configured if s <= max_num_seqs}))


def bucket_for(num_requests: int, sizes: Sequence[int]) -> int | None:
    """The smallest recorded size that holds ``num_requests`` (sizes ascending); None: none does."""
    return next((s for s in sizes if s >= num_requests), None)


def is_uniform_decode(layouts: Sequence[BatchLayout]) -> bool:
    """One KV cache group and every request one query row."""
    return len(layouts) == 1 and all(q == 1 for q in layouts[0].query_lens)


@attrs.frozen
class GraphPlan:
    """What :func:`graph_plan` decided: the recorder and sizes, or the reasons there are none."""

    graphs: StepGraphs | None
    sizes: tuple[int, ...]
    reasons: tuple[str, ...]


def graph_plan(config, platform, layers, runner_kind: str) -> GraphPlan:
    """The platform's step graphs and the sizes to record for this engine, or why none: they
    need a platform that records them, a backend that declares support, one attention kind, and
    no KV connector, speculation or pooling (each reads or writes state around the forward that
    a replay would skip)."""
    reasons = []
    graphs = None if config.enforce_eager else platform.step_graphs()
    if config.enforce_eager:
        reasons.append("enforce_eager is set")
    elif graphs is None:
        reasons.append(f"the {platform.name} platform records no step graphs")
    unsupported = [b.name for b in layers.backends if b.cuda_graph_support == "none"]
    if unsupported:
        reasons.append(f"attention backend {', '.join(unsupported)} declares cuda_graph_support 'none'")
    if not layers.uniform:
        reasons.append("the model's layers attend in several ways")
    if config.parallel.tensor_parallel_size > 1:
        reasons.append("tensor parallelism runs each rank's forward eagerly (no per-rank graphs yet)")
    if config.cache.calculate_kv_scales and config.cache.kv_cache_dtype != "auto":
        reasons.append("calculate_kv_scales: a recording would hold scales known after the first prefill")
    for option, why in (("kv_connector", "a KV connector"), ("speculative_config", "speculative decoding")):
        if getattr(config, option):
            reasons.append(f"{why} is configured")
    if runner_kind == "pooling":
        reasons.append("the pooling runner samples nothing to decode")
    max_num_seqs = config.scheduler.max_num_seqs
    defaults = graphs.default_sizes(max_num_seqs) if graphs is not None else ()
    sizes = capture_sizes(config.cuda_graph_sizes, defaults, max_num_seqs)
    if graphs is not None and not sizes:
        reasons.append(f"cuda_graph_sizes leaves no size up to max_num_seqs {max_num_seqs}")
    if reasons:
        return GraphPlan(None, (), tuple(reasons))
    return GraphPlan(graphs, sizes, ())


def graph_memory_estimate(plan: GraphPlan, hf_config, dtype: torch.dtype) -> int:
    """Bytes the recordings hold: per row, a few [hidden] and [intermediate] activations (sized
    generously) of one layer where the recordings share one pool
    (:attr:`~engine.interfaces.StepGraphs.shares_activations`: the largest bucket's rows), of
    every layer where each recording keeps its own (every bucket's rows); the float32 logits of
    the greedy recordings' rows (of the largest such bucket where shared); and each
    recording's own overhead. The other steps' logits are computed outside them."""
    if not plan.sizes:
        return 0
    hidden = getattr(hf_config, "hidden_size", 0)
    intermediate = getattr(hf_config, "intermediate_size", 4 * hidden)
    row_bytes = (8 * hidden + 4 * intermediate) * dtype.itemsize
    greedy = greedy_sizes(plan.graphs, plan.sizes)
    logits_row_bytes = getattr(hf_config, "vocab_size", 0) * 4
    if plan.graphs.shares_activations:
        rows, logits_rows = max(plan.sizes), max(greedy, default=0)
    else:
        rows, logits_rows = sum(plan.sizes) * getattr(hf_config, "num_hidden_layers", 1), sum(greedy)
    recordings = len(plan.sizes) + len(greedy)
    return rows * row_bytes + logits_rows * logits_row_bytes + plan.graphs.overhead_bytes * recordings


def start(
    model,
    attention,
    kv_caches,
    plan: GraphPlan,
    max_blocks: int,
    platform,
    vocab_size: int,
    max_positions: int,
    lora=None,
    defer: bool = False,
) -> StepGraphRunner | None:
    """The recorded decode steps of ``plan``, or None (decode runs eagerly; the reasons are
    logged, and a recording that fails — a forward that syncs with the host, or one a tape
    cannot replay — or does not reproduce the eager forward falls back to eager). ``lora``: the
    model's :class:`engine.layers.lora.LoRABatch` when adapters may run. ``defer``: record
    nothing yet; the caller records bucket by bucket (:meth:`StepGraphRunner.record_next`) when
    it is idle, and meanwhile decode steps of the buckets not yet recorded run eagerly."""
    if not plan.sizes:
        log = logger.info if platform.device_type == "cuda" else logger.debug
        log("decode steps run eagerly: %s", "; ".join(plan.reasons))
        return None
    runner = StepGraphRunner(
        model, attention, kv_caches, plan, max_blocks, platform.device, vocab_size, max_positions, lora
    )
    if defer:
        return runner
    try:
        runner.capture()
    except RuntimeError as exc:
        logger.info("decode steps run eagerly: recording %s failed: %s", plan.graphs.name, exc)
        return None
    return runner


@attrs.frozen
class RecordedDecode:
    inputs: DecodeInputs  # the static buffers its recordings read
    metadata: object  # the attention metadata built over them, which they read too
    graph: object = None  # a StepGraphs recording of the forward (replay()), or None: none yet
    hidden: torch.Tensor | None = None  # the static output it writes, [size, hidden]
    greedy: object = None  # a recording of the forward and its greedy tokens, or None
    tokens: torch.Tensor | None = None  # the static output that one writes, [size]


class StepGraphRunner:
    """The model's decode forward recorded per bucket; ``replay`` runs a step through one, or
    returns None for the caller to run it eagerly."""

    def __init__(
        self,
        model,
        attention,
        kv_caches: list[torch.Tensor],
        plan: GraphPlan,
        max_blocks: int,
        device: torch.device,
        vocab_size: int,
        max_positions: int,
        lora=None,
    ):
        self.model, self.attention, self.kv_caches = model, attention, kv_caches
        self.lora = lora  # the LoRABatch the layers read, or None
        self.lora_rows: dict[int, torch.Tensor] = {}  # per bucket: the static row -> slot buffer
        self.recorder, self.sizes = plan.graphs, plan.sizes
        self.max_blocks, self.device = max_blocks, device
        self.vocab_size, self.max_positions = vocab_size, max_positions  # what check() may feed
        self.graphs: dict[int, RecordedDecode] = {}
        self.pending = sorted(self.sizes, reverse=True)  # the buckets not yet recorded
        self.score_eagerly: set[int] = set()  # the buckets whose greedy steps have no recording
        self.greedy_run: tuple[int | None, int] = (None, 0)  # (bucket, its greedy steps in a row)
        self.inputs = DecodeInputs.empty(max(self.sizes), max_blocks, device)  # every bucket's, as prefixes

    def _forward(self, inputs: DecodeInputs, metadata, lora_rows: torch.Tensor | None = None):
        if self.lora is not None:
            self.lora.indices = lora_rows
        step = StepContext(self.attention, metadata, self.kv_caches, (), [], ())
        return self.model(inputs.input_ids, inputs.positions, step)

    def _no_adapters(self, size: int) -> torch.Tensor | None:
        """A row -> slot buffer of ``size`` rows of no adapter (-1), or None without LoRA."""
        if self.lora is None:
            return None
        return torch.full((size,), -1, dtype=torch.int64, device=self.device)

    def capture(self, check: bool = True) -> None:
        """Record every bucket still pending that start-up records
        (:attr:`~engine.interfaces.StepGraphs.start_up_sizes_up_to`; ``check``: as
        :meth:`record_next`); the others wait for their first step."""
        limit = self.recorder.start_up_sizes_up_to
        for size in [s for s in self.pending if limit is None or s <= limit]:
            self._record(size, check)

    @property
    def idle_pending(self) -> list[int]:
        """The buckets still pending that a server records while idle
        (:attr:`~engine.interfaces.StepGraphs.idle_sizes_up_to`), largest first."""
        limit = self.recorder.idle_sizes_up_to
        return [s for s in self.pending if limit is None or s <= limit]

    def record_next(self, check: bool = True) -> bool:
        """Record the largest bucket still pending of those idle time records (the smaller fit
        its memory); the first one recorded is checked (:meth:`check`) before any replay can
        serve, unless ``check`` is False (a test showing what an unchecked recording would
        replay). True while such buckets remain. Raises RuntimeError where a recording fails or
        differs from eager."""
        if pending := self.idle_pending:
            self._record(pending[0], check)
        return bool(self.idle_pending)

    def _record_when_needed(self, size: int, greedy: bool) -> bool:
        """Record bucket ``size``'s forward (``greedy``: its greedy recording) now, for the step
        about to run, where start-up left the size (above
        :attr:`~engine.interfaces.StepGraphs.start_up_sizes_up_to`): the forward's by the first
        step that needs it, the greedy one by the :data:`GREEDY_AFTER_STEPS`-th greedy step of
        the size in a row. False where it does not (the step replays the forward's or runs
        eagerly), or its recording failed: then this size and the larger run eagerly
        (:meth:`_give_up_from`), or every size does where none was recorded, as at start-up."""
        limit = self.recorder.start_up_sizes_up_to
        if limit is None or size <= limit or (size not in self.graphs and size not in self.pending):
            return False  # start-up's to record, or given up
        if greedy and (
            size in self.score_eagerly
            or not self._takes_greedy(size)
            or self.greedy_run[1] < GREEDY_AFTER_STEPS
        ):
            return False
        try:
            # the step's eager forerunners and start-up's recordings compiled its kernels
            self._record(size, forward=not greedy, greedy=greedy, warm_up=False)
        except RuntimeError as exc:
            logger.info("decode steps run eagerly: recording %s failed: %s", self.recorder.name, exc)
            self.graphs.clear()
            self.pending.clear()
            return False
        return self._has(size, greedy)

    def _takes_greedy(self, size: int) -> bool:
        """Whether bucket ``size`` gets a greedy recording (:func:`greedy_sizes`)."""
        return bool(greedy_sizes(self.recorder, [size]))

    def _has(self, size: int, greedy: bool) -> bool:
        """Whether bucket ``size`` has its forward's recording (``greedy``: its greedy one)."""
        recorded = self.graphs.get(size)
        return recorded is not None and (recorded.greedy if greedy else recorded.graph) is not None

    def _record(
        self, size: int, check: bool = True, forward: bool = True, greedy: bool = True, warm_up: bool = True
    ) -> None:
        """Record bucket ``size``'s ``forward`` and ``greedy`` recordings (after a forward of its
        size, ``warm_up``: kernels compiled, allocator settled); the LoRA batch's row -> slot
        indices are left as they were (a step about to replay has set its rows' adapters; the
        recording runs without any)."""
        step_slots = self.lora.indices if self.lora is not None else None
        try:
            self._record_bucket(size, check, forward, greedy, warm_up)
        finally:
            if self.lora is not None:
                self.lora.indices = step_slots

    @torch.inference_mode()
    def _record_bucket(self, size: int, check: bool, forward: bool, greedy: bool, warm_up: bool) -> None:
        if size not in self.graphs:
            self.pending.remove(size)
            inputs = self.inputs.prefix(size)
            self.graphs[size] = RecordedDecode(inputs, self.attention.build_graph_metadata(inputs.layout))
            if (lora_rows := self._no_adapters(size)) is not None:
                self.lora_rows[size] = lora_rows
        recorded = self.graphs[size]
        # over padding, whatever a replay or a check left in the shared buffers: a greedy replay
        # leaves them moved on past its step (after a row's last position, one the rotary table lacks)
        recorded.inputs.copy_(DecodeInputs.empty(size, self.max_blocks, self.device))

        def run_forward():
            return self._forward(recorded.inputs, recorded.metadata, self.lora_rows.get(size))

        if warm_up:
            run_forward()
        if forward and not self._record_forward(size, run_forward, check):
            return
        if greedy:
            self._record_greedy(size, run_forward, check)
        if not self.pending:
            logger.info(
                "recorded %s of decode steps for batches of %s",
                self.recorder.name,
                ", ".join(map(str, self.sizes)),
            )

    def _record_forward(self, size: int, forward, check: bool) -> bool:
        """Give bucket ``size`` the recording of ``forward``; the first bucket to have one is
        checked (``check``; on failure the caller drops this runner, bucket and all). False where
        it cannot be recorded and a smaller bucket was (:meth:`_give_up_from`)."""
        try:
            graph, hidden = self.recorder.record(forward)
        except RuntimeError as exc:
            if not any(self._has(smaller, False) for smaller in self.graphs if smaller < size):
                raise
            self._give_up_from(size, exc)
            return False
        first = not any(self._has(other, False) for other in self.graphs)
        self.graphs[size] = attrs.evolve(self.graphs[size], graph=graph, hidden=hidden)
        if check and first:
            self.check(size)
        return True

    def _record_greedy(self, size: int, forward, check: bool) -> None:
        """Give bucket ``size`` (if :func:`greedy_sizes` holds it) a recording of
        ``forward``, its greedy tokens and its inputs moved on by them (a burst's next step
        reads them; a step that replays once is filled again before its next), where the
        model's scoring can be recorded (else its greedy steps score eagerly: ``score_eagerly``).
        Each is checked (``check``; the scoring may take another path at another size): one
        whose tokens differ from the eager ones (a kernel of the head that no recording sees)
        is dropped, said in the log."""
        if not self._takes_greedy(size):
            return
        block_size, inputs = self.attention.spec.block_size, self.graphs[size].inputs

        def greedy_step():
            tokens = greedy_tokens(self.model, forward())
            if tokens is not None:  # None: a tensor-parallel rank that scores nothing
                inputs.advance(tokens, block_size)
            return tokens

        try:
            greedy, tokens = self.recorder.record(greedy_step)
        except RuntimeError as exc:
            logger.debug("greedy decode steps of %d sequences score outside the recording: %s", size, exc)
            self.score_eagerly.add(size)
            return
        recorded = attrs.evolve(self.graphs[size], greedy=greedy, tokens=tokens)
        if check and not self._same_greedy_tokens(recorded):
            logger.info(
                "greedy decode steps of %d sequences score outside the recording: its greedy tokens, "
                "or the inputs it moves on by them, differ from eager (a kernel it did not record?)",
                size,
            )
            self.score_eagerly.add(size)
            return
        self.graphs[size] = recorded

    def _give_up_from(self, size: int, exc: RuntimeError) -> None:
        """Bucket ``size`` could not be recorded where a smaller one was: neither can the larger
        ones be, as far as anyone can tell (a platform's forward may leave its recordable kernels
        from some batch size on, e.g. for a library GEMM on big batches), so they run eagerly
        and the smaller keep their recordings."""
        logger.info("decode steps of %d sequences and more run eagerly: recording failed: %s", size, exc)
        self.sizes = tuple(s for s in self.sizes if s < size)
        self.pending = [s for s in self.pending if s < size]
        for dropped in [s for s in self.graphs if s >= size]:
            del self.graphs[dropped]

    @torch.inference_mode()
    def check(self, size: int | None = None, seed: int = 0) -> None:
        """Replay bucket ``size`` (default: the largest recorded) on random tokens, positions and lengths
        (keys in the null block) and compare with the eager forward of the same inputs; raise
        RuntimeError when they differ (a recording that froze something it should read at run
        time)."""
        size = size or max(s for s in self.graphs if self._has(s, False))
        recorded, inputs = self.graphs[size], self._random_inputs(size, seed)
        eager = self._eager(inputs)
        recorded.inputs.copy_(inputs)
        recorded.graph.replay()
        if not torch.equal(recorded.hidden, eager):
            raise RuntimeError(
                f"a replay differs from the eager forward of the same batch of {size} "
                f"(max |difference| {(recorded.hidden.float() - eager.float()).abs().max():.3g})"
            )

    def _same_greedy_tokens(self, recorded: RecordedDecode, seed: int = 0) -> bool:
        """Whether ``recorded``'s greedy recording, replayed on random inputs as :meth:`check`
        replays, gives the eager greedy tokens of the same inputs, and leaves its inputs moved
        on by them (what a burst's next step reads)."""
        size = recorded.inputs.input_ids.shape[0]
        inputs = self._random_inputs(size, seed)
        eager = greedy_tokens(self.model, self._eager(inputs))
        recorded.inputs.copy_(inputs)
        recorded.greedy.replay()
        moved_on = recorded.inputs
        return (
            torch.equal(recorded.tokens, eager)
            and torch.equal(moved_on.input_ids, eager)
            and torch.equal(moved_on.positions, inputs.positions + 1)
            and torch.equal(moved_on.layout.seq_lens, inputs.layout.seq_lens + 1)
        )

    def _random_inputs(self, size: int, seed: int) -> DecodeInputs:
        """A decode step of ``size`` random lengths, keys in the null block, each row's token and
        position drawn for its slot: rows that share a slot (more rows than a block holds) write
        the same keys and values there, whichever of a kernel's threads writes last."""
        device, block_size = self.device, self.attention.spec.block_size
        gen = torch.Generator().manual_seed(seed)
        lens = torch.randint(1, block_size + 1, (size,), generator=gen, dtype=torch.int32)
        tokens = torch.randint(0, self.vocab_size, (block_size,), generator=gen)
        positions = torch.randint(0, self.max_positions, (block_size,), generator=gen)
        return DecodeInputs(
            tokens[lens - 1].to(device),
            positions[lens - 1].to(device),
            BatchLayout(
                query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),
                seq_lens=lens.to(device),
                block_table=torch.zeros(size, self.max_blocks, dtype=torch.int32, device=device),
                slot_mapping=(lens - 1).to(device, torch.int64),
                query_lens=(1,) * size,
                seq_lens_host=tuple(lens.tolist()),
            ),
        )

    def _eager(self, inputs: DecodeInputs) -> torch.Tensor:
        """The eager forward's hidden states of ``inputs``, without adapters; the LoRA batch's
        slots are left unset (a replay sets its bucket's own)."""
        size = inputs.input_ids.shape[0]
        metadata = self.attention.build_metadata(inputs.layout)
        hidden = self._forward(inputs, metadata, self._no_adapters(size)).clone()
        if self.lora is not None:
            self.lora.indices = None
        return hidden

    def replay(self, batch) -> torch.Tensor | None:
        """The hidden states of ``batch`` (the runner's ``StepInput``) through a recorded
        step, or None when it is not a uniform decode step that a bucket holds."""
        size = self._bucket(batch)
        if size is None:
            return None
        recorded = self._fill(size, batch)
        recorded.graph.replay()
        return recorded.hidden[: batch.layout.num_requests]

    def runs_bursts_of(self, rows: int) -> bool:
        """Whether a decode step of ``rows`` requests may run as a burst (:meth:`replay_greedy`
        with ``steps`` above 1): only a greedy recording runs one, and only the buckets
        :func:`greedy_sizes` holds have one."""
        size = bucket_for(rows, self.sizes)
        return size is not None and self._takes_greedy(size)

    def replay_greedy(self, batch, steps: int = 1) -> torch.Tensor | None:
        """The greedy tokens of ``batch`` (a ``StepInput`` whose rows all decode greedily)
        through its bucket's greedy recording, or None when it has none: the caller then
        replays the forward (:meth:`replay`) or runs it eagerly. ``steps`` above 1: that many
        decode steps in a row (each request has slots for them), each step's tokens fed to the
        next (:meth:`DecodeInputs.advance`, recorded at the step's end); their tokens
        [requests, steps]."""
        size = self._bucket(batch, greedy=True)
        if size is None:
            return None
        recorded, rows = self._fill(size, batch), batch.layout.num_requests
        recorded.greedy.replay()
        if steps == 1:
            return recorded.tokens[:rows]
        tokens = torch.empty(rows, steps, dtype=recorded.tokens.dtype, device=self.device)
        tokens[:, 0] = recorded.tokens[:rows]
        for step in range(1, steps):  # the recording moved the inputs on by its tokens
            recorded.greedy.replay()
            tokens[:, step] = recorded.tokens[:rows]
        return tokens

    def _bucket(self, batch, greedy: bool = False) -> int | None:
        """The bucket that holds ``batch`` with its forward's recording (``greedy``: its greedy
        one), recorded now where this is the first step to need it (:meth:`_record_when_needed`);
        None where ``batch`` is not a uniform decode step or no bucket holds it so recorded."""
        if not is_uniform_decode(batch.layouts):
            return None
        size = bucket_for(batch.layout.num_requests, self.sizes)
        if greedy:  # the greedy steps of a size in a row, which its greedy recording waits for
            self.greedy_run = (size, self.greedy_run[1] + 1 if self.greedy_run[0] == size else 1)
        if size is None or batch.layout.block_table.shape[1] > self.max_blocks:
            return None  # no bucket holds it
        if not self._has(size, greedy) and not self._record_when_needed(size, greedy):
            return None  # its bucket is not recorded (yet, or ever)
        return size

    def _fill(self, size: int, batch) -> RecordedDecode:
        """Bucket ``size``'s recording, with ``batch``'s inputs written to its static buffers."""
        recorded = self.graphs[size]
        recorded.inputs.fill(batch.input_ids, batch.positions, batch.layout)
        lora_rows = self.lora_rows.get(size)
        if lora_rows is not None:  # this step's slots (set by the LoRA manager), -1 past them
            lora_rows.fill_(-1)
            if self.lora.indices is not None:
                lora_rows[: batch.layout.num_requests].copy_(self.lora.indices)
        return recorded
