"""What every front end (``LLM``, ``engine generate``, the server) does to a request before the
engine core queues it: check its prompt against the model and fan its ``n`` samples out into
engine requests. One implementation, so the three never disagree on what a prompt may be or
on how sample ``i`` is seeded."""

from __future__ import annotations

import attrs

from engine.messages.sampling_params import InvalidParam, SamplingParams, is_int


def check_prompt(
    ids,
    vocab_size: int,
    max_model_len: int,
    max_tokens: int | None = None,
    param: str = "prompt",
    generates: bool = True,
) -> None:
    """InvalidParam naming ``param`` (or ``max_tokens``) unless ``ids`` are token ids of this
    vocabulary that leave room in the context for at least one token (``max_tokens`` of them
    when given); a prompt that pools (``generates=False``) may fill the whole context."""
    if not isinstance(ids, list) or not ids:
        raise InvalidParam(param, f"{param}: must contain at least one token")
    if not all(is_int(t) and 0 <= t < vocab_size for t in ids):
        raise InvalidParam(param, f"{param}: token ids must be integers in [0, {vocab_size})")
    if len(ids) > max_model_len - generates:
        raise InvalidParam(
            param,
            f"{param}: {len(ids)} tokens do not fit the context of {max_model_len} "
            f"(max_model_len){' with room to generate' if generates else ''}",
        )
    if max_tokens is not None and len(ids) + max_tokens > max_model_len:
        raise InvalidParam(
            "max_tokens",
            f"max_tokens={max_tokens} plus the prompt's {len(ids)} tokens exceed "
            f"the context of {max_model_len} tokens",
        )


def fan_out(parent_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """(engine request id, parameters) per sample: the parent itself for one sample; else
    ``parent-i`` with ``n=1`` and seed ``seed + i``. Only the first sample computes prompt
    log-probs (they are the prompt's, the same for all; a request that wants them skips the
    prefix cache, so every other sample would recompute the prompt for the same numbers)."""
    if params.n == 1:
        return [(parent_id, params)]
    return [
        (
            f"{parent_id}-{i}",
            attrs.evolve(
                params,
                n=1,
                seed=None if params.seed is None else params.seed + i,
                prompt_logprobs=params.prompt_logprobs if i == 0 else None,
            ),
        )
        for i in range(params.n)
    ]
