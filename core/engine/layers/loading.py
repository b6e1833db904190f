"""Loading Hugging Face checkpoint tensors into a module built from engine layers."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from engine.layers.checkpoint import materialize, narrow_rows
from engine.layers.linear import Linear
from engine.layers.moe import EXPERT_PROJECTIONS, FusedMoE

# checkpoint projection -> (fused Linear, shard index)
FUSED_PROJECTIONS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def decoder_rename(tied: bool) -> Callable[[str], str | None]:
    """The ``rename`` of a Hugging Face decoder: rotary tables are not parameters here, and a
    model with tied embeddings has no LM head of its own to load."""
    return lambda name: None if "rotary_emb" in name or (tied and name == "lm_head.weight") else name


def route_by_prefix(name: str, prefixes: Sequence[tuple[str, str, str]], family: str) -> tuple[str, str]:
    """(part, name inside that part) of a multimodal checkpoint's parameter ``name``: the first
    ``(prefix, part, inner prefix)`` of ``prefixes`` it starts with, the prefix swapped for the
    inner one (checkpoints of one family spell their text model, vision tower and projector
    under several prefixes across transformers versions); a ValueError naming ``family``."""
    for prefix, part, inner in prefixes:
        if name.startswith(prefix):
            return part, inner + name[len(prefix) :]
    raise ValueError(f"{family} checkpoint: unexpected parameter {name!r}")


def load_whole(
    module: nn.Module, state: dict[str, torch.Tensor], what: str, optional: tuple[str, ...] = ()
) -> None:
    """Load ``state`` into ``module``, one built by another library (a multimodal model's vision
    tower, run as ``transformers`` builds it): every parameter must be there but those under
    an ``optional`` prefix (buffers such as position ids are rebuilt by the module); a
    ValueError naming ``what`` lists what is missing or unexpected."""
    missing, unexpected = module.load_state_dict(state, strict=False)
    parameters = dict(module.named_parameters())
    missing = [name for name in missing if name in parameters and not name.startswith(optional)]
    if missing or unexpected:
        raise ValueError(f"{what}: missing {missing[:3]}, unexpected {unexpected[:3]}")


def split_fused(
    weights: Iterable[tuple[str, torch.Tensor]], parts: dict[str, list[tuple[str, int]]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with each projection a checkpoint stores fused (Phi-3's ``qkv_proj``, GLM-4's
    ``gate_up_proj``: ``parts`` maps its name to its parts' (name, rows), in order) cut along its
    output rows into the parts' names, so that each loads into its shard as a separate
    projection would (a tensor-parallel rank then reads only its rows). Only a ``weight`` or
    ``bias`` with those rows is cut: any other (a quantized checkpoint's packed tensors)
    raises ValueError naming it."""
    for name, tensor in weights:
        module_path, _, param = name.rpartition(".")
        parent, _, projection = module_path.rpartition(".")
        if projection not in parts:
            yield name, tensor
            continue
        rows = [size for _, size in parts[projection]]
        if param not in ("weight", "bias") or tensor.shape[0] != sum(rows):
            raise ValueError(
                f"checkpoint tensor {name!r} {tuple(tensor.shape)}: a fused projection is cut into "
                f"{parts[projection]} for a weight or bias of {sum(rows)} rows only"
            )
        prefix = f"{parent}." if parent else ""
        for (part, size), start in zip(parts[projection], itertools.accumulate(rows, initial=0)):
            yield f"{prefix}{part}.{param}", narrow_rows(tensor, start, size)


def load_checkpoint(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: Callable[[str], str | None] = lambda name: name,
    fused: dict[str, tuple[str, int]] = FUSED_PROJECTIONS,
) -> None:
    """Copy (name, tensor) pairs into ``module``: q/k/v and gate/up projections into their
    fused :class:`Linear`'s shards, ``<moe>.experts.<e>.<projection>.<param>`` into the
    :class:`FusedMoE` at ``<moe>.experts`` (experts on other ranks skipped), other Linear
    parameters through ``load_shard`` (so the quant method's storage is used, and a
    tensor-parallel layer reads only its rank's part of a lazy
    :class:`engine.layers.checkpoint.CheckpointSlice`), everything else by name, read whole.
    ``rename`` maps a checkpoint name to the module's (None skips it). Unknown names and
    parameters left unloaded raise ValueError naming them."""
    modules = dict(module.named_modules())
    state = dict(module.named_parameters()) | dict(module.named_buffers())
    missing = set(module.state_dict())
    for checkpoint_name, tensor in weights:
        name = rename(checkpoint_name)
        if name is None:
            continue
        module_path, _, param = name.rpartition(".")
        parent, _, projection = module_path.rpartition(".")
        experts_path, _, expert = parent.rpartition(".")
        if expert.isdigit() and isinstance(modules.get(experts_path), FusedMoE):
            modules[experts_path].load_expert(projection, param, int(expert), tensor)
            missing.discard(f"{experts_path}.{EXPERT_PROJECTIONS[projection][0]}.{param}")
        elif projection in fused:
            target, shard = fused[projection]
            path = f"{parent}.{target}" if parent else target
            modules[path].load_shard(param, tensor, shard)
            missing.discard(f"{path}.{param}")
        elif isinstance(modules.get(module_path), Linear):
            modules[module_path].load_shard(param, tensor)
            missing.discard(name)
        elif name in state:
            state[name].data.copy_(materialize(tensor))
            missing.discard(name)
        else:
            raise ValueError(
                f"checkpoint tensor {checkpoint_name!r} matches nothing in {type(module).__name__}"
            )
    if missing:
        shown = sorted(missing)
        raise ValueError(
            f"checkpoint lacks {shown[:5]}{' ...' if len(shown) > 5 else ''} for {type(module).__name__}"
        )
