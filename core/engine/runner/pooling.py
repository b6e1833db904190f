"""The pooling path: a request that pools runs its whole prompt in one step and finishes with
one vector made from the model's final hidden states of its rows (no sampling, no decode).

:class:`PoolerConfig` is vLLM's ``--pooler-config``: the model's default pooler
(``Model.default_pooling_type``; normalised by default, as vLLM's embed task) overridden by
the engine option ``override_pooler_config``. :class:`Pooler` runs in the model runner."""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from engine.messages.pooling_params import PoolingParams

POOLING_TYPES = ("LAST", "CLS", "MEAN")
RUNNERS = ("auto", "generate", "pooling")
POOLING_TASKS = ("embed", "classify", "score")  # vLLM's --task spellings of the pooling runner


@attrs.frozen
class PoolerConfig:
    pooling_type: str = attrs.field(default="LAST", validator=attrs.validators.in_(POOLING_TYPES))
    normalize: bool = True

    @classmethod
    def resolve(cls, model_default: str, override: dict | None) -> PoolerConfig:
        """The model's default pooling type (normalised) under ``override`` (``{"pooling_type":
        "MEAN", "normalize": false}``; keys as vLLM's PoolerConfig); ValueError naming a bad key."""
        override = dict(override or {})
        unknown = set(override) - {"pooling_type", "normalize"}
        if unknown:
            raise ValueError(
                f"override_pooler_config: unknown keys {sorted(unknown)} "
                "(this engine reads pooling_type and normalize)"
            )
        pooling_type = str(override.get("pooling_type", model_default)).upper()
        if pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"override_pooler_config: pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                f"got {override['pooling_type']!r}"
            )
        normalize = override.get("normalize", True)
        if not isinstance(normalize, bool):
            raise ValueError(f"override_pooler_config: normalize must be a boolean, got {normalize!r}")  # noqa: TRY004
        return cls(pooling_type, normalize)


def resolve_runner(runner: str, task: str | None, generative: bool) -> str:
    """``generate`` or ``pooling`` from vLLM's ``runner`` (auto: pooling for a model without an
    LM head) and its older ``task`` spelling (``embed``, ``classify`` and ``score`` are pooling)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner: must be one of {', '.join(RUNNERS)}, got {runner!r}")
    by_task = {None: None, "auto": None, "generate": "generate"} | dict.fromkeys(POOLING_TASKS, "pooling")
    if task not in by_task:
        raise ValueError(f"task: must be auto, generate, {', '.join(POOLING_TASKS)}, got {task!r}")
    wanted = by_task[task]
    if wanted and runner not in ("auto", wanted):
        raise ValueError(f"task: {task!r} contradicts runner={runner!r}")
    chosen = wanted or (runner if runner != "auto" else ("generate" if generative else "pooling"))
    if chosen == "generate" and not generative:
        raise ValueError(
            "runner: this model has no LM head and cannot generate; use runner='pooling' (--runner pooling)"
        )
    return chosen


class Pooler:
    """Pools each finished request's rows of the step's final hidden states into one float32
    vector: LAST (its last prompt token: the one a causal decoder has seen everything by),
    CLS (its first) or MEAN (over its prompt); then, for ``embed``, the request's
    ``dimensions`` cut and L2 normalisation (the request's ``normalize``, else the config's),
    or, for ``classify``, the model's ``classify`` head and its activation (:func:`label_probs`)."""

    def __init__(self, config: PoolerConfig, classify=None):
        self.config = config
        self.classify = classify  # the model's classification head, for a classifier

    def __call__(self, hidden: torch.Tensor, spans: list[tuple[object, int, int]]) -> dict[str, torch.Tensor]:
        """``spans``: (request, first row, end row) per request whose whole prompt is in this step."""
        starts = torch.tensor([start for _, start, _ in spans], device=hidden.device)
        ends = torch.tensor([end for _, _, end in spans], device=hidden.device)
        kind = self.config.pooling_type
        if kind == "LAST":
            pooled = hidden[ends - 1].float()
        elif kind == "CLS":
            pooled = hidden[starts].float()
        else:
            pooled = torch.stack([hidden[s:e].float().mean(dim=0) for _, s, e in spans])
        out = {
            request.request_id: self._finish(vector, request.pooling_params)
            for (request, _, _), vector in zip(spans, pooled)
            if request.pooling_params.task == "embed"
        }
        rows = [i for i, (request, _, _) in enumerate(spans) if request.pooling_params.task == "classify"]
        if rows:
            probs = label_probs(self.classify(pooled[rows].to(hidden.dtype)).float()).cpu()
            out.update((spans[i][0].request_id, p) for i, p in zip(rows, probs))
        return out

    def _finish(self, vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        normalize = self.config.normalize if params.normalize is None else params.normalize
        if normalize:
            vector = F.normalize(vector, dim=-1)
        return vector.cpu()


def label_probs(logits: torch.Tensor) -> torch.Tensor:
    """A classifier's logits [N, labels] as probabilities, as vLLM's classify and score tasks
    (and sentence-transformers' CrossEncoder) return them: the sigmoid of a one-label model's
    logit (a relevance score in [0, 1]), a softmax over the labels otherwise."""
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
