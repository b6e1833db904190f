"""ModelRunner: one step on the device — flatten, forward, logits, sample, verify drafts; for
pooling requests, pool their hidden states instead (:mod:`engine.runner.pooling`)."""

from __future__ import annotations

import attrs
import torch

from engine.interfaces import StepContext
from engine.messages.step import StepPlan, StepResult, TokenLogprobs
from engine.runner import kv_transfer, sampler
from engine.runner.batch import FlatBatch, flatten
from engine.runner.encoder_cache import EncoderCache, step_embeddings
from engine.runner.layer_attention import LayerAttention
from engine.runner.positions import AxisPositions


@attrs.frozen
class StepInput:
    """What every tensor-parallel rank needs to run one step's forward: the flattened tokens,
    their positions, each KV cache group's attention layout, the rows to score (sampled
    rows, then prompt-logprob rows), the image rows' encoder output (rank 0 runs the
    encoder: :mod:`engine.runner.encoder_cache`) and, when a row runs a LoRA adapter, each
    scheduled request's (``LoRARequest`` or None, row count), from which every rank's
    :class:`engine.lora.manager.LoRAManager` sets the same slots. Picklable: a multi-rank
    executor broadcasts it."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    layouts: tuple
    logits_rows: tuple[int, ...]
    mm_rows: torch.Tensor | None = None
    mm_embeds: torch.Tensor | None = None
    lora_rows: tuple = ()
    greedy: bool = False  # every logits row takes its first maximum and reads nothing else of them
    burst: int = 1  # greedy decode steps it may run in a row (StepPlan.decode_burst)

    @property
    def layout(self):
        """The first KV cache group's layout."""
        return self.layouts[0]

    def to(self, device) -> StepInput:
        """The same input with its tensors on ``device``: the broadcast carries host tensors
        (a CUDA tensor would unpickle onto the sender's device index) and each rank moves
        them to its own device. On the CPU nothing is copied."""
        return StepInput(
            self.input_ids.to(device),
            self.positions.to(device),
            tuple(_layout_to(layout, device) for layout in self.layouts),
            self.logits_rows,
            None if self.mm_rows is None else self.mm_rows.to(device),
            None if self.mm_embeds is None else self.mm_embeds.to(device),
            self.lora_rows,
            self.greedy,
            self.burst,
        )


def _lora_rows(plan: StepPlan, batch: FlatBatch) -> tuple:
    """Each scheduled request's (adapter, row count); empty when no row runs an adapter."""
    adapters = [item.request.lora_request for item in plan.scheduled]
    if not any(adapters):
        return ()
    return tuple((adapter, end - start) for adapter, (_, start, end) in zip(adapters, batch.spans))


def _rows(hidden: torch.Tensor, rows: tuple[int, ...]) -> torch.Tensor:
    """``hidden[rows]``; ``hidden`` itself when ``rows`` are all its rows in order (a decode
    step: every row samples), which spares a gather and its index tensor each step."""
    if len(rows) == hidden.shape[0] and rows == tuple(range(len(rows))):
        return hidden
    return hidden[torch.tensor(rows, device=hidden.device)]


def _recordable(step: StepInput) -> bool:
    """Whether a step graph may run ``step``: no image rows, one position axis."""
    return step.mm_rows is None and step.positions.dim() == 1


def _layout_to(layout, device):
    tensors = {f.name: getattr(layout, f.name) for f in attrs.fields(type(layout))}
    return attrs.evolve(
        layout,
        **{name: value.to(device) for name, value in tensors.items() if isinstance(value, torch.Tensor)},
    )


class ModelRunner:
    def __init__(
        self,
        model,
        layers: LayerAttention,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        logits_processors=(),
        kv_connector=None,
        pooler=None,
    ):
        self.model = model
        self.layers = layers
        self.attention = attention = layers.first
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.group_block_sizes = layers.group_block_sizes(block_size)  # fixed for the model: taken once
        self.device = device
        self.logits_processors = list(logits_processors)
        self.connector = kv_connector
        self.pooler = pooler  # an engine.runner.pooling.Pooler when the engine runs pooling requests
        self.keep_hidden_states = False  # a drafter that reads the target's hidden states sets this
        self.hidden_layers: tuple[int, ...] = ()  # ... and these, if it reads inner layers
        # how execute runs a step's forward: a multi-rank executor wraps it (broadcast first)
        self.forward_step = self.forward
        self.graphs = None  # an engine.runner.step_graphs.StepGraphRunner when decode steps replay
        self.lora = None  # an engine.lora.manager.LoRAManager when adapters may run: sets each step's slots
        self.encoder_cache: EncoderCache | None = None  # set for a multimodal model
        # a model of several position axes (M-RoPE) gets [axes, T] positions
        self.axis_positions = AxisPositions(model, device) if getattr(model, "position_axes", 1) > 1 else None
        if kv_connector is not None:
            kv_connector.register_kv_caches(kv_caches, attention.block_dim)

    @torch.inference_mode()
    def execute(
        self,
        plan: StepPlan,
        group_tables: list[list[list[int]]],
        bitmask: torch.Tensor | None = None,
        kv_meta: object = None,
    ) -> StepResult:
        """``group_tables``: per KV cache group, each scheduled request's block table.
        ``kv_meta``: the KV connector's metadata for this step (None: no transfers)."""
        batch = flatten(plan, group_tables, self.group_block_sizes, self.device)
        rows = batch.sample_rows + batch.prompt_rows
        sampling = sampler.SamplingRows(batch.sample_owners, self.device, batch.sample_drafts)
        mm_rows, mm_embeds = self._image_rows(plan, batch)
        positions = batch.positions
        if self.axis_positions is not None:
            positions = self.axis_positions.step_positions(plan, batch.spans, positions)
        step = StepInput(
            batch.input_ids,
            positions,
            batch.layouts,
            tuple(rows),
            mm_rows,
            mm_embeds,
            _lora_rows(plan, batch) if self.lora is not None else (),
            self._argmax_only(sampling, batch, bitmask),
            plan.decode_burst,
        )
        with kv_transfer.connector_step(self.connector, kv_meta):
            hidden, aux, logits = self.forward_step(step)
        result = StepResult({})
        if batch.pool_spans:
            result.pooled.update(self.pooler(hidden, batch.pool_spans))
        if not rows:
            return result
        n = len(batch.sample_rows)
        if n:
            self._sample(logits[:n], sampling, batch, plan, bitmask, result)
        if batch.prompt_rows:
            self._prompt_logprobs(logits[n:], batch, result)
        if self.keep_hidden_states:
            self._keep_hidden(torch.cat(aux, dim=-1) if aux else hidden, batch, plan, result)
        return result

    def _argmax_only(self, rows: sampler.SamplingRows, batch: FlatBatch, bitmask) -> bool:
        """Whether the step's logits rows are all sampled by their first maximum alone
        (:func:`sampler.argmax_only`, no grammar, logits processor or prompt logprobs): the
        model may then give their tokens in place of the logits (``Model.compute_greedy``)."""
        if not batch.sample_rows or batch.prompt_rows or bitmask is not None or self.logits_processors:
            return False
        return sampler.argmax_only(rows)

    def _image_rows(
        self, plan: StepPlan, batch: FlatBatch
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The step's image rows and their encoder output (None, None: no image row)."""
        if self.encoder_cache is None:
            return None, None
        offsets = [start for _, start, _ in batch.spans]
        return step_embeddings(plan.scheduled, offsets, self.encoder_cache, self._encode, self.device)

    def _encode(self, item) -> torch.Tensor:
        return self.model.encode_multimodal({name: t.to(self.device) for name, t in item.data.items()})

    @staticmethod
    def _keep_hidden(hidden, batch: FlatBatch, plan: StepPlan, result: StepResult) -> None:
        """Hidden states of the rows whose tokens are now known to be right: the computed
        known tokens plus the accepted drafts."""
        for (rid, start, end), item in zip(batch.spans, plan.scheduled):
            accepted = len(result.sampled.get(rid, [None])) - 1
            result.hidden_states[rid] = hidden[start : start + item.num_new_tokens + accepted]

    @torch.inference_mode()
    def forward(self, step: StepInput) -> tuple[torch.Tensor | None, list[torch.Tensor], torch.Tensor | None]:
        """(hidden states, the drafter's inner-layer states, the scores of ``step.logits_rows``:
        their logits [N, vocab], or in a greedy step (``step.greedy``) their tokens [N]
        (:func:`sampler.greedy_tokens`); None when there are no such rows, and on a
        tensor-parallel rank other than 0). A greedy decode step that a step graph replays with
        its tokens (``StepGraphRunner.replay_greedy``) has no hidden states (None): no one
        reads them where step graphs run (no drafter, no pooling); where ``step.burst`` allows
        several steps in a row, their tokens are [N, steps]."""
        if self.lora is not None:
            self.lora.prepare(list(step.lora_rows))
        if (tokens := self._replay_greedy(step)) is not None:
            return None, [], tokens
        hidden, aux = self._forward(step)
        if not step.logits_rows:
            return hidden, aux, None
        scored = _rows(hidden, step.logits_rows)
        if step.greedy:
            return hidden, aux, sampler.greedy_tokens(self.model, scored)
        return hidden, aux, self.model.compute_logits(scored)

    def runs_bursts_of(self, rows: int) -> bool:
        """Whether a decode step of ``rows`` requests may be planned as a burst
        (``StepPlan.decode_burst``): where its step graphs could replay one."""
        return self.graphs is not None and self.graphs.runs_bursts_of(rows)

    def _replay_greedy(self, step: StepInput) -> torch.Tensor | None:
        """The tokens of a greedy step that scores every row, through its bucket's greedy
        recording (``StepGraphRunner.replay_greedy``); None where it has none."""
        if self.graphs is None or not step.greedy or not _recordable(step):
            return None
        rows = len(step.logits_rows)
        if rows != step.input_ids.shape[0] or step.logits_rows != tuple(range(rows)):
            return None
        return self.graphs.replay_greedy(step, step.burst)

    def _forward(self, batch: StepInput) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if (
            self.graphs is not None
            and _recordable(batch)
            and (hidden := self.graphs.replay(batch)) is not None
        ):
            return hidden, []
        aux: list[torch.Tensor] = []
        layers = () if self.layers.uniform else self.layers.step_layers(batch.layouts)
        metadata = layers[0][1] if layers else self.attention.build_metadata(batch.layouts[0])
        step = StepContext(
            self.attention,
            metadata,
            self.kv_caches,
            self.hidden_layers if self.keep_hidden_states else (),
            aux,
            layers,
            self.connector,
            batch.layout.slot_mapping if self.connector is not None else None,
            batch.mm_rows,
            batch.mm_embeds,
        )
        return self.model(batch.input_ids, batch.positions, step), aux

    def transfer_kv(self, kv_meta: object) -> None:
        """Run the KV connector's transfers of a step that computes nothing."""
        with kv_transfer.connector_step(self.connector, kv_meta):
            for layer in range(len(self.kv_caches)):
                self.connector.wait_for_layer_load(layer)

    def _sample(
        self,
        scores,
        rows: sampler.SamplingRows,
        batch: FlatBatch,
        plan: StepPlan,
        bitmask,
        result: StepResult,
    ) -> None:
        """``scores``: the sample rows' logits, or (a greedy step the model scored) their tokens:
        [N], or [N, steps] for a burst of decode steps (a request's row holds its tokens)."""
        if scores.is_floating_point():
            tokens, probs, logprobs = self._sample_logits(scores, rows, batch, bitmask)
        else:
            tokens, probs, logprobs = scores, None, None
        token_list = tokens.tolist()
        if tokens.dim() == 2:  # a burst: each request's row of tokens (no drafts, no logprobs)
            sampling_items = (item for item in plan.scheduled if item.samples)
            result.sampled.update(
                (item.request.request_id, out) for item, out in zip(sampling_items, token_list)
            )
            return
        chosen = list(token_list)
        row = 0
        for item in plan.scheduled:
            if not item.samples:
                continue
            request, k = item.request, len(item.spec_token_ids)
            out = token_list[row : row + k + 1]
            if k:
                out = sampler.verify_drafts(
                    out,
                    item.spec_token_ids,
                    None if probs is None else probs[row : row + k + 1],
                    request,
                    request.spec_probs,
                )
            chosen[row : row + len(out)] = out
            result.sampled[request.request_id] = out
            n_logprobs = request.sampling_params.logprobs
            if logprobs is not None and n_logprobs is not None:
                result.logprobs[request.request_id] = sampler.topn_logprobs(
                    logprobs[row : row + len(out)], torch.tensor(chosen[row : row + len(out)]), n_logprobs
                )
            row += k + 1

    def _sample_logits(self, logits, rows: sampler.SamplingRows, batch: FlatBatch, bitmask):
        """(each row's token, the sampling distributions where drafts need them, the raw
        logprobs where a row asks for logprobs)."""
        if bitmask is not None:
            sampler.apply_bitmask(logits, bitmask)
        # vLLM's default logprobs_mode (raw_logprobs): before processors, masks, penalties, temperature
        logprobs = logits.log_softmax(dim=-1) if rows.max_logprobs is not None else None
        for processor in self.logits_processors:
            logits = processor.apply(logits, rows.requests)
        sampler.apply_token_masks(logits, rows)
        sampler.apply_penalties(logits, rows)
        tokens, probs = sampler.sample(logits, rows, need_probs=any(batch.sample_drafts))
        return tokens, probs, logprobs

    def _prompt_logprobs(self, logits, batch: FlatBatch, result: StepResult) -> None:
        logprobs = logits.log_softmax(dim=-1)
        targets = torch.tensor(batch.prompt_targets, device=self.device)
        start = 0
        while start < len(batch.prompt_owners):
            request = batch.prompt_owners[start]
            end = start
            while end < len(batch.prompt_owners) and batch.prompt_owners[end] is request:
                end += 1
            entries: list[TokenLogprobs] = sampler.topn_logprobs(
                logprobs[start:end], targets[start:end], request.sampling_params.prompt_logprobs
            )
            result.prompt_logprobs[request.request_id] = entries
            start = end
