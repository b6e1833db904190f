"""Reading a compressed-tensors ``quantization_config``: the schemes its ``config_groups``
declare and the modules each targets, checked at start-up; anything the engine cannot run is
refused in one line naming it.

The layout (compressed-tensors' ``QuantizationConfig``)::

    {"quant_method": "compressed-tensors", "format": "pack-quantized",
     "quantization_status": "compressed", "ignore": ["lm_head"],
     "config_groups": {"group_0": {"targets": ["Linear"], "format": ...,
        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                    "symmetric": true, "actorder": null},
        "input_activations": null | {"num_bits": 8, "type": "int", "strategy": "token",
                                     "dynamic": true, "symmetric": true}}}}

Modules no scheme covers (``ignore``d, or not targeted) are stored as float ``weight``
tensors; the method keeps them float (:mod:`engine_quant_compressed_tensors.method`). Several
groups (mixed precision: e.g. W4A16 attention, W8A8 MLP) each quantize the modules their
``targets`` match, matched as vLLM matches them (:func:`group_of`).
"""

from __future__ import annotations

import re

import attrs

LM_HEAD = "lm_head"  # a tied model's shares the embedding's tensor; no vocabulary table is quantized here
FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "nvfp4-pack-quantized")
NVFP4_GROUP = 16


@attrs.frozen
class Weights:
    """The ``weights`` arguments: ``bits`` per value, ``kind`` "int" or "float", ``strategy``
    (tensor, channel, group, block, tensor_group), ``group`` inputs per scale (group
    strategies), ``block`` (rows, columns) per scale (block strategy), ``symmetric``."""

    bits: int
    kind: str
    strategy: str
    group: int | None = None
    block: tuple[int, int] | None = None
    symmetric: bool = True


# (input_activations' dynamic, strategy) -> where an activation's scales come from
ACTIVATION_SCALES = {
    (True, "token"): "per-token",  # each row's own, computed per step
    (False, "tensor"): "static",  # the checkpoint's input_scale
    (
        "local",
        "tensor_group",
    ): "nvfp4",  # per 16 inputs, computed per step, over the checkpoint's input_global_scale
}


@attrs.frozen
class Activations:
    """The ``input_activations`` arguments; ``scales`` a value of :data:`ACTIVATION_SCALES`."""

    bits: int
    kind: str
    scales: str


@attrs.frozen
class Scheme:
    format: str
    weights: Weights
    activations: Activations | None


def _refuse(message: str) -> ValueError:
    return ValueError(f"quantization: compressed-tensors {message}")


def _field(args: dict, where: str, name: str, kind: type | tuple[type, ...]):
    value = args.get(name)
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise _refuse(f"{where}.{name} must be {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def read_weights(args: object, where: str) -> Weights:
    if not isinstance(args, dict):
        raise _refuse(f"{where} must be an object, got {args!r}")
    bits = _field(args, where, "num_bits", int)
    kind = _field(args, where, "type", str)
    strategy = _field(args, where, "strategy", str)
    if args.get("actorder") == "group":
        raise _refuse(f"{where}.actorder 'group' is not supported (its inputs are stored out of order)")
    group = None
    if strategy in ("group", "tensor_group"):
        group = _field(args, where, "group_size", int)
        if group <= 0:
            raise _refuse(f"{where}.group_size {group} must be positive")
    block = None
    if strategy == "block":
        block = tuple(args.get("block_structure") or ())
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise _refuse(
                f"{where}.block_structure must be two positive sizes, got {args.get('block_structure')!r}"
            )
    symmetric = args.get("symmetric", True)
    return Weights(bits, kind, strategy, group, block, bool(symmetric))


def read_activations(args: object, where: str) -> Activations | None:
    if args is None:
        return None
    if not isinstance(args, dict):
        raise _refuse(f"{where} must be an object or null, got {args!r}")
    if args.get("symmetric", True) is not True:
        raise _refuse(f"{where}: asymmetric activations are not supported")
    dynamic, strategy = args.get("dynamic", False), args.get("strategy")
    scales = ACTIVATION_SCALES.get((dynamic, strategy))
    if scales is None or scales == "nvfp4" and args.get("group_size") != NVFP4_GROUP:
        raise _refuse(
            f"{where}: only dynamic per-token, static per-tensor or NVFP4 scales are supported, "
            f"got strategy {strategy!r} with dynamic {dynamic!r}"
        )
    return Activations(_field(args, where, "num_bits", int), _field(args, where, "type", str), scales)


@attrs.frozen
class Group:
    """A config group: its name, its ``targets`` and the scheme they are quantized by."""

    name: str
    targets: tuple[str, ...]
    scheme: Scheme


# the class-name target of every linear module (the checkpoint's names carry no class)
LINEAR_TARGET = "Linear"


def read_groups(config: dict) -> tuple[Group, ...]:
    """The checkpoint's config groups, each scheme checked."""
    if config.get("quantization_status", "compressed") != "compressed":
        raise _refuse(
            f"quantization_status {config.get('quantization_status')!r}: only compressed checkpoints load"
        )
    if config.get("sparsity_config"):
        raise _refuse("sparsity_config is not supported (only dense weights)")
    top_format = config.get("format", "mixed-precision")
    if top_format not in (*FORMATS, "mixed-precision"):
        raise _refuse(f"format {top_format!r} is not supported (only {', '.join(FORMATS)})")
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse(f"config_groups must name at least one group, got {groups!r}")
    read = []
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise _refuse(f"config_groups.{name} must be an object, got {group!r}")
        scheme = Scheme(
            str(group.get("format") or top_format),
            read_weights(group.get("weights"), f"config_groups.{name}.weights"),
            read_activations(group.get("input_activations"), f"config_groups.{name}.input_activations"),
        )
        read.append(Group(name, _targets(group.get("targets"), name), _checked(scheme)))
    _check_targets_agree(read)
    return tuple(read)


def _targets(targets: object, group: str) -> tuple[str, ...]:
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise _refuse(f"config_groups.{group}.targets must be a list of module names, got {targets!r}")
    for target in targets:
        _compiled(target, f"config_groups.{group}.targets entry")
    return tuple(targets)


def _compiled(entry: str, where: str) -> None:
    if entry.startswith("re:"):
        try:
            re.compile(entry[3:])
        except re.error as error:
            raise _refuse(f"{where} {entry!r} is not a regular expression: {error}") from None


def _check_targets_agree(groups: list[Group]) -> None:
    """Refuse one target in two groups of different schemes (which would the module take?)."""
    seen: dict[str, Group] = {}
    for group in groups:
        for target in group.targets:
            other = seen.setdefault(target, group)
            if other.scheme != group.scheme:
                raise _refuse(
                    f"config_groups {other.name!r} and {group.name!r} both target {target!r} "
                    "with different schemes"
                )


def group_of(module: str, groups: tuple[Group, ...], ignore: tuple[str, ...]) -> Group | None:
    """The group whose scheme quantizes ``module`` (a checkpoint module name), as vLLM matches
    it: none if ``ignore`` names it; else a group with a target naming it (the name, or ``re:``
    and a pattern matched from the start) before one targeting its class (``Linear``: every
    linear module, the only class a checkpoint's quantized tensors belong to). Groups of
    different schemes matching it alike are refused, naming them."""
    if any(_names(entry, module) for entry in ignore):
        return None
    by_name = [group for group in groups if any(_names(target, module) for target in group.targets)]
    matched = by_name or [group for group in groups if LINEAR_TARGET in group.targets]
    if len({group.scheme for group in matched}) > 1:
        names = ", ".join(repr(group.name) for group in matched)
        raise _refuse(f"module {module!r} is targeted by config_groups {names} of different schemes")
    return matched[0] if matched else None


def _names(entry: str, module: str) -> bool:
    """Whether a target or ``ignore`` entry names ``module``: equal, or ``re:`` and a pattern
    matching it from the start."""
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    return entry == module


def _checked(scheme: Scheme) -> Scheme:
    """Refuse a scheme no path below runs, naming what of it."""
    w, a = scheme.weights, scheme.activations
    expected = {
        "pack-quantized": ("int", (4, 8), ("group", "channel"), (None,)),
        "int-quantized": ("int", (8,), ("group", "channel", "tensor"), (None, ("int", 8))),
        "float-quantized": ("float", (8,), ("tensor", "channel", "block"), (None, ("float", 8))),
        "nvfp4-pack-quantized": ("float", (4,), ("tensor_group",), (None, ("float", 4))),
    }
    if scheme.format not in expected:
        raise _refuse(f"format {scheme.format!r} is not supported (only {', '.join(FORMATS)})")
    kind, bits, strategies, activations = expected[scheme.format]
    if w.kind != kind or w.bits not in bits:
        raise _refuse(f"{scheme.format} holds {kind} weights of {bits} bits, not {w.kind} of {w.bits}")
    if w.strategy not in strategies:
        raise _refuse(
            f"{scheme.format} weight strategy {w.strategy!r} is not supported (only {', '.join(strategies)})"
        )
    if (None if a is None else (a.kind, a.bits)) not in activations:
        raise _refuse(f"{scheme.format} with {a.kind} {a.bits}-bit input activations is not supported")
    if not w.symmetric and scheme.format != "pack-quantized":
        raise _refuse(f"{scheme.format}: asymmetric weights are not supported")
    if a is not None and w.strategy == "group":
        raise _refuse(
            f"{scheme.format}: quantized activations with group-wise weight scales are not supported"
        )
    if scheme.format == "nvfp4-pack-quantized" and w.group != NVFP4_GROUP:
        raise _refuse(f"nvfp4 group_size {w.group} is not supported (NVFP4 scales blocks of {NVFP4_GROUP})")
    return scheme


def read_ignore(config: dict) -> tuple[str, ...]:
    """The ``ignore`` entries: module names, ``re:``-prefixed patterns, or class names."""
    ignore = config.get("ignore", [])
    if not isinstance(ignore, list) or not all(isinstance(entry, str) and entry for entry in ignore):
        raise _refuse(f"ignore must be a list of module names, got {ignore!r}")
    for entry in ignore:
        _compiled(entry, "ignore entry")
    return tuple(ignore)


def check_ignore(ignore: tuple[str, ...], modules: set[str]) -> None:
    """Refuse an ``ignore`` entry that names none of the checkpoint's ``modules``."""
    for entry in ignore:
        if not _names_a_module(entry, modules):
            raise _refuse(f"ignore entry {entry!r} names no module of the checkpoint")


def _names_a_module(entry: str, modules: set[str]) -> bool:
    """Whether an ``ignore`` entry matches one of the checkpoint's ``modules`` as compressed-tensors
    matches it (a name, or ``re:`` and a pattern matched from the start). A class name
    (``LlamaDecoderLayer``) names no path the checkpoint spells, so it counts as found, as does
    the LM head."""
    if entry.startswith("re:"):
        return any(_names(entry, module) for module in modules)
    is_class_name = entry.isidentifier() and entry[0].isupper()
    return is_class_name or entry == LM_HEAD or entry in modules
