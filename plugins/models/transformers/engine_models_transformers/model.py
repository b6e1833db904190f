"""Any causal LM through ``transformers``' own modelling code, attending on the engine's paged KV
cache: the model is ``AutoModelForCausalLM.from_config`` with its attention implementation set to
:data:`ATTENTION`, a function registered in ``transformers.AttentionInterface``. The engine's step
is one flattened batch of every request's tokens, run as a batch of one sequence (``input_ids``
and ``position_ids`` of shape [1, T]); the model computes its embeddings, rotary tables (from the
step's positions), projections and MLPs itself, and each layer's attention call lands in
:func:`paged_attention`, which hands q/k/v to an :class:`engine.layers.Attention` for the layer
(its ``layer_idx``): the selected attention backend writes the step's K/V into the paged cache
and attends each request over its own blocks, so continuous batching, chunked prefill, prefix
caching and preemption work as for a native model. ``transformers`` builds no mask for an
attention implementation it has no mask function for, so none is computed. Where a layer attends
travels in a context variable set for one forward (:func:`attending_through`), not as a forward
keyword: some families (Falcon) do not hand their keywords down to the attention call.

What the KV cache must hold (layers, heads, head size, each layer's query scale, sliding window
and soft-cap) is read by running two tokens through the model with a recording attention
function (:func:`probe_layers`), not from config fields that differ per family."""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import math
import re
from collections.abc import Callable, Iterable

import attrs
import torch
from torch import nn
from transformers import AttentionInterface

from engine.interfaces import FALLBACK_ARCHITECTURE, AttentionKind, KVLayout, Model, StepContext
from engine.layers import Attention

ATTENTION = "engine_paged"  # the attn_implementation name registered with transformers
# config fields by which a family's CausalLM head changes the logits after the LM head matmul,
# which this fallback (it applies the output embedding only) does not reproduce
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
UNSUPPORTED_ATTENTION_KWARGS = ("s_aux", "sinks")  # attention sinks (gpt-oss): no backend takes them


# (module, query, key, value, scaling, kwargs) -> output: where the running forward's layers attend
_ROUTE: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("engine_attend", default=None)


@contextlib.contextmanager
def attending_through(route: Callable):
    """Every :func:`paged_attention` call in this block (this thread's forward) goes to ``route``."""
    token = _ROUTE.set(route)
    try:
        yield
    finally:
        _ROUTE.reset(token)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature: query [1, heads, T, head_dim], key and value
    [1, kv_heads, T, head_dim] -> ([1, T, heads, head_dim], no weights), through the route of
    the enclosing :func:`attending_through`; the mask (none is built) is not used."""
    attend = _ROUTE.get()
    if attend is None:
        raise RuntimeError(
            f"{type(module).__name__} attended through {ATTENTION!r} outside the engine's forward"
        )
    return attend(module, query, key, value, scaling, kwargs), None


AttentionInterface.register(ATTENTION, paged_attention)


@attrs.frozen
class LayerShape:
    """How one layer attends, as the probe saw it."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_dim: int
    causal: bool
    kind: AttentionKind


class ProbeError(ValueError):
    """The model's attention cannot be routed to the paged KV cache; the message says why."""


def probe_layers(base_model: nn.Module, device) -> list[LayerShape]:
    """Each attention layer's shape and kind, in ``layer_idx`` order: two tokens through
    ``base_model`` with a recording attention function (outputs are zeros; the weights do not
    matter). Raises :class:`ProbeError` when the modelling code does not attend through
    transformers' attention interface, or its layers do not all carry a ``layer_idx``."""
    seen: dict[object, LayerShape] = {}

    def record(module, query, key, value, scaling, kwargs):
        head_dim = query.shape[-1]
        unsupported = [name for name in UNSUPPORTED_ATTENTION_KWARGS if kwargs.get(name) is not None]
        if unsupported:
            raise ProbeError(f"its attention takes {', '.join(unsupported)}, which no attention backend does")
        kind = AttentionKind(
            sliding_window=kwargs.get("sliding_window"),
            logit_softcap=kwargs.get("softcap"),
            query_scale=None if scaling is None or math.isclose(scaling, head_dim**-0.5) else float(scaling),
        )
        causal = getattr(module, "is_causal", True)
        layer = getattr(module, "layer_idx", None)
        seen[layer] = LayerShape(query.shape[1], key.shape[1], head_dim, value.shape[-1], causal, kind)
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])

    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    with torch.no_grad(), attending_through(record):
        base_model(input_ids=ids, position_ids=torch.arange(2, device=device)[None], use_cache=False)
    return _layers_in_order(seen)


def _layers_in_order(seen: dict) -> list[LayerShape]:
    if not seen:
        raise ProbeError(
            "its modelling code does not attend through transformers' attention interface "
            "(AttentionInterface), so its attention cannot be routed to the paged KV cache"
        )
    if set(seen) != set(range(len(seen))):
        raise ProbeError(
            f"its attention layers carry layer_idx {sorted(seen, key=str)}, not 0..{len(seen) - 1}"
        )
    return [seen[i] for i in range(len(seen))]


class TransformersForCausalLM(Model):
    """The fallback: any ``AutoModelForCausalLM`` architecture whose attention goes through
    transformers' attention interface. Registered as :data:`FALLBACK_ARCHITECTURE`; the engine
    picks it for an architecture no model plugin claims, or for every one with
    ``model_impl="transformers"``."""

    architectures = (FALLBACK_ARCHITECTURE,)

    def __init__(self, ctx):
        super().__init__(ctx)
        from transformers import AutoModelForCausalLM
        from transformers.initialization import no_init_weights

        method = getattr(ctx.linear_method, "name", "unquantized")
        if method != "unquantized":
            raise ValueError(f"quantization: {method} is not supported by the transformers fallback")
        config = copy.deepcopy(ctx.hf_config)  # the engine's config keeps its own attention setting
        with no_init_weights():  # load_weights overwrites every parameter: drawing them first is wasted time
            self.hf = AutoModelForCausalLM.from_config(config, dtype=ctx.dtype, attn_implementation=ATTENTION)
        self.hf.tie_weights()  # skipped with the initialisation: a tied LM head shares the embeddings
        self.hf.eval().requires_grad_(False)
        name = type(self.hf).__name__
        try:
            self.shapes = probe_layers(self.hf.base_model, ctx.device)
        except ProbeError as exc:
            raise ValueError(f"model: the transformers fallback cannot run {name}: {exc}") from None
        self._check_uniform_heads(name)
        self.attention = nn.ModuleList(Attention(i) for i in range(len(self.shapes)))

    def _check_uniform_heads(self, name: str) -> None:
        first = self.shapes[0]
        heads = {(s.num_heads, s.num_kv_heads, s.head_dim) for s in self.shapes}
        reasons = [
            f"layers attend with different head counts or sizes {sorted(heads)}" if len(heads) > 1 else "",
            f"value head size {first.value_dim} differs from the key's {first.head_dim}"
            if any(s.value_dim != s.head_dim for s in self.shapes)
            else "",
            "its attention is not causal" if not all(s.causal for s in self.shapes) else "",
        ]
        reasons = [r for r in reasons if r]
        if reasons:
            raise ValueError(f"model: the transformers fallback cannot run {name}: {'; '.join(reasons)}")

    @classmethod
    def supports(cls, hf_config) -> list[str]:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        reasons = []
        model_type = hf_config.model_type
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            reasons.append(f"transformers has no causal-LM class (AutoModelForCausalLM) for {model_type!r}")
        if getattr(hf_config, "is_encoder_decoder", False):
            reasons.append("encoder-decoder models are not supported")
        if getattr(hf_config, "alibi", False):
            reasons.append("ALiBi position biases are not supported (no attention backend takes them)")
        if getattr(hf_config, "quantization_config", None):
            reasons.append("quantized checkpoints are not supported")
        transforms = [f for f in LOGIT_TRANSFORMS if getattr(hf_config, f, None) not in (None, 1, 1.0)]
        if transforms:
            reasons.append(
                f"logits transformed after the LM head ({', '.join(transforms)}) are not supported"
            )
        return reasons

    @classmethod
    def example_configs(cls) -> dict[str, dict]:
        """Families no model plugin covers: GPT-2 (learned positions, Conv1D projections),
        GPT-NeoX (partial rotary, parallel residual), Falcon (multi-query attention), OPT
        (learned positions with an offset)."""
        return {
            "GPT2LMHeadModel": dict(
                model_type="gpt2", vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128
            ),
            "GPTNeoXForCausalLM": dict(
                model_type="gpt_neox",
                vocab_size=256,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=128,
            ),
            "FalconForCausalLM": dict(
                model_type="falcon",
                vocab_size=256,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=128,
            ),
            "OPTForCausalLM": dict(
                model_type="opt",
                vocab_size=256,
                hidden_size=64,
                ffn_dim=128,
                word_embed_proj_dim=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=128,
            ),
        }

    def kv_layout(self) -> KVLayout:
        first = self.shapes[0]
        kinds = tuple(s.kind for s in self.shapes)
        plain = all(kind == AttentionKind() for kind in kinds)
        return KVLayout(
            len(self.shapes), first.num_heads, first.num_kv_heads, first.head_dim, () if plain else kinds
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepContext) -> torch.Tensor:
        with attending_through(functools.partial(self._attend, step)):
            out = self.hf.base_model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        return out[0][0]

    def _attend(self, step, module, query, key, value, scaling, kwargs) -> torch.Tensor:
        """One layer's attention on the paged cache: [1, heads, T, d] in, [1, T, heads, d] out."""
        q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
        out = self.attention[module.layer_idx](q, k, v, step)
        return out.reshape(q.shape[0], q.shape[1], -1)[None]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.hf.get_output_embeddings()(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint tensors under the names transformers would load them by
        (:func:`checkpoint_renamer`); names the model class lists as ignorable on load (old
        GPT-2 checkpoints' causal-mask buffers) are skipped. Unknown names and parameters left
        unloaded raise ValueError naming them."""
        state = self.hf.state_dict(keep_vars=True)
        rename = checkpoint_renamer(self.hf, state)
        ignore = [re.compile(p) for p in getattr(self.hf, "_keys_to_ignore_on_load_unexpected", None) or ()]
        loaded: set[int] = set()
        unknown = []
        for name, tensor in weights:
            target = state.get(rename(name))
            if target is None:
                if not any(p.search(name) for p in ignore):
                    unknown.append(name)
                continue
            with torch.no_grad():
                target.copy_(tensor)
            loaded.add(id(target))
        if unknown:
            raise ValueError(
                f"checkpoint: {len(unknown)} weights are not parameters of transformers' "
                f"{type(self.hf).__name__}: {', '.join(unknown[:5])}"
            )
        # a tied parameter (the LM head sharing the embeddings) is one object under two names
        missing = [name for name, param in self.hf.named_parameters() if id(param) not in loaded]
        if missing:
            raise ValueError(f"checkpoint: no weights for {', '.join(missing[:5])}")


def checkpoint_renamer(hf_model, state: dict) -> Callable[[str], str]:
    """Checkpoint name -> the model's parameter name, as transformers 5 renames on load: the
    model's conversion mapping (GPT-NeoX's ``embed_out`` is ``lm_head``; legacy ``gamma`` /
    ``beta``) and the base model's prefix added or dropped. A name that needs a converting
    transform (experts stacked into one tensor, fused projections split) raises ValueError."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(hf_model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]

    def rename(name: str) -> str:
        renamed, converted = rename_source_key(name, renamings, converters, hf_model.base_model_prefix, state)
        if converted is not None:
            raise ValueError(
                f"checkpoint: {name} must be converted ({converted!r}) to load into transformers' "
                f"{type(hf_model).__name__}, which the transformers fallback does not do"
            )
        return renamed

    return rename
