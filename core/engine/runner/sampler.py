"""Sampling over the rows that sample this step, vectorized across requests.

Order: grammar bitmask → (logprobs are taken here: vLLM's default ``logprobs_mode``,
``raw_logprobs``, the model's distribution under the grammar only) → logits-processor
plugins → token masks (``logit_bias``, ``allowed_token_ids``, ``bad_words``, the
``min_tokens`` ban) → penalties → greedy argmax, or temperature → top-k → top-p → min-p →
one inverse-CDF draw per row.
A seeded request draws its noise from its own generator, so its output does not
depend on what else is in the batch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from engine.messages.step import TokenLogprobs
from engine.native.rows import first_max

_BIT = torch.arange(32, dtype=torch.int32)


class SamplingRows:
    """Per-row parameters of one step. ``requests[i]`` owns row ``i``; a request
    verifying drafts owns several consecutive rows, and in row ``i`` the drafts before it
    (``drafts[i]``) count as output already (penalties, min_tokens)."""

    def __init__(
        self, requests: Sequence, device: torch.device, drafts: Sequence[tuple[int, ...]] | None = None
    ):
        self.requests = list(requests)
        self.drafts = list(drafts) if drafts is not None else [()] * len(self.requests)
        self.params = [r.sampling_params for r in self.requests]
        self.device = device
        self.all_greedy = all(p.greedy for p in self.params)
        self.temperatures = [p.temperature if not p.greedy else 1.0 for p in self.params]
        self.top_k = [p.top_k for p in self.params]
        self.max_logprobs = max(
            (p.logprobs for p in self.params if p.logprobs is not None),
            default=None,
            key=lambda n: float("inf") if n == -1 else n,
        )

    # The per-row tensors only sampling rows read: a step of greedy rows (the common decode
    # step) builds none of them.
    @functools.cached_property
    def greedy(self) -> torch.Tensor:
        return torch.tensor([p.greedy for p in self.params], device=self.device)

    @functools.cached_property
    def temperature(self) -> torch.Tensor:
        return torch.tensor(self.temperatures, device=self.device).unsqueeze(1)

    @functools.cached_property
    def top_p(self) -> torch.Tensor:
        return torch.tensor([p.top_p for p in self.params], device=self.device).unsqueeze(1)

    @functools.cached_property
    def min_p(self) -> torch.Tensor:
        return torch.tensor([p.min_p for p in self.params], device=self.device).unsqueeze(1)


def greedy_tokens(model, hidden: torch.Tensor) -> torch.Tensor | None:
    """The greedy token of each row of ``hidden`` (the scored rows' final hidden states), for a
    step where :func:`argmax_only` holds: the model's own (``Model.compute_greedy``) or its
    logits' first maximum; None on a tensor-parallel rank that gets no logits. The eager step
    and the step graphs' greedy recordings both score through here."""
    tokens = model.compute_greedy(hidden)
    if tokens is not None:
        return tokens
    logits = model.compute_logits(hidden)
    return None if logits is None else first_max(logits)


def argmax_only(rows: SamplingRows) -> bool:
    """Whether every row's token is the first maximum of its raw logits and nothing else of them
    is read: greedy rows with no logprobs, no token masks (``logit_bias``, allowed and bad words,
    ``min_tokens`` not yet reached) and no penalties. The step's grammar bitmask and logits
    processors are the caller's to rule out."""
    if not rows.all_greedy or rows.max_logprobs is not None:
        return False
    for request, drafts in zip(rows.requests, rows.drafts):
        p = request.sampling_params
        if p.masks_tokens or p.uses_penalties:
            return False
        if _below_min_tokens(request, drafts):
            return False
    return True


def _below_min_tokens(request, drafts: Sequence[int]) -> bool:
    """Whether a row's output so far (its drafts before it counting) is under ``min_tokens``:
    its stop tokens and EOS are then masked."""
    return len(request.output_token_ids) + len(drafts) < request.sampling_params.min_tokens


def apply_penalties(logits: torch.Tensor, rows: SamplingRows) -> None:
    """Repetition (prompt + output, HF semantics) and frequency/presence (output, OpenAI)."""
    for i, (request, drafts) in enumerate(zip(rows.requests, rows.drafts)):
        p = request.sampling_params
        if not p.uses_penalties:
            continue
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(
                sorted(set(request.all_token_ids) | set(drafts)), dtype=torch.long, device=logits.device
            )
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        output = request.output_token_ids + list(drafts)
        if output and (p.frequency_penalty or p.presence_penalty):
            out = torch.tensor(output, dtype=torch.long, device=logits.device)
            counts = torch.zeros_like(row).index_add_(0, out, torch.ones_like(out, dtype=row.dtype))
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


class _Indices:
    """(row, token) pairs gathered across the batch, applied in one tensor op."""

    def __init__(self):
        self.rows: list[int] = []
        self.tokens: list[int] = []

    def add(self, row: int, tokens) -> None:
        self.tokens += tokens
        self.rows += [row] * (len(self.tokens) - len(self.rows))

    def tensors(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.tensor(self.rows, dtype=torch.long, device=device),
            torch.tensor(self.tokens, dtype=torch.long, device=device),
        )


def banned_bad_words(params, output: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """vLLM's ``bad_words``: the last token of each bad word's sequence whose preceding
    tokens end the output so far (a one-token word is always banned)."""
    longest = max(len(ids) for ids in params.bad_words_token_ids) - 1
    tail = (list(output[-longest:]) + list(drafts))[-longest:] if longest else []
    return [
        ids[-1]
        for ids in params.bad_words_token_ids
        if len(ids) - 1 <= len(tail) and tuple(tail[len(tail) - len(ids) + 1 :]) == ids[:-1]
    ]


def apply_token_masks(logits: torch.Tensor, rows: SamplingRows) -> None:
    """Per request: ``logit_bias`` added; tokens outside ``allowed_token_ids``, the bad
    words' next tokens and, below ``min_tokens``, EOS and the stop token ids set to -inf.
    Python only gathers indices; each kind is one tensor op over the whole batch."""
    banned, allowed, bias = _Indices(), _Indices(), _Indices()
    bias_values: list[float] = []
    allowed_rows: list[int] = []
    for i, (request, drafts) in enumerate(zip(rows.requests, rows.drafts)):
        p = request.sampling_params
        if _below_min_tokens(request, drafts):
            banned.add(i, p.stop_token_ids)
            if request.eos_token_id is not None and not p.ignore_eos:
                banned.add(i, (request.eos_token_id,))
        if not p.masks_tokens:
            continue
        if p.logit_bias:
            bias.add(i, p.logit_bias.keys())
            bias_values += p.logit_bias.values()
        if p.allowed_token_ids is not None:
            allowed.add(i, p.allowed_token_ids)
            allowed_rows.append(i)
        if p.bad_words_token_ids:
            banned.add(i, banned_bad_words(p, request.output_token_ids, drafts))
    if bias.rows:
        values = torch.tensor(bias_values, dtype=logits.dtype, device=logits.device)
        logits.index_put_(bias.tensors(logits.device), values, accumulate=True)
    if allowed_rows:  # the allowed logits kept aside, their rows filled with -inf, then put back
        pairs = allowed.tensors(logits.device)
        kept = logits[pairs]
        logits[torch.tensor(allowed_rows, dtype=torch.long, device=logits.device)] = float("-inf")
        logits[pairs] = kept
    if banned.rows:
        logits[banned.tensors(logits.device)] = float("-inf")
    if banned.rows or allowed_rows:
        _check_some_token_left(logits, sorted(set(banned.rows) | set(allowed_rows)))


class NoTokenLeft(ValueError):
    """Every token of a row is masked: the request's constraints contradict each other."""


def _check_some_token_left(logits: torch.Tensor, masked_rows: list[int]) -> None:
    """Raise rather than sample from nothing (the step's fault isolation then finishes only
    the request whose masks and grammar leave no token, with this message)."""
    empty = logits[torch.tensor(masked_rows, device=logits.device)].isneginf().all(dim=1)
    if bool(empty.any()):
        raise NoTokenLeft(
            "no token is left to sample: allowed_token_ids, bad_words, min_tokens and the grammar "
            "together exclude every token"
        )


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """bitmask int32 [N, ceil(V/32)] -> disallowed tokens set to -inf, in one op."""
    allowed = ((bitmask.unsqueeze(-1) >> _BIT.to(bitmask.device)) & 1).bool().flatten(1)
    logits.masked_fill_(~allowed[:, : logits.shape[1]], float("-inf"))


_FIRST_CANDIDATES = 64  # top-k / top-p look at this many highest logits first, then 4x more


def _candidates(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor):
    """Rows' surviving tokens under top-k → top-p → min-p, as (probabilities renormalized
    over the survivors [n, K], token ids [n, K]), highest first, zero where dropped.

    Exactly what sorting the whole vocabulary gives (top-k's survivors renormalized, then
    the smallest prefix holding ``top_p`` of that mass, then min-p against the top token),
    but from ``topk``: a row's nucleus lies within its K highest logits once those hold
    ``top_p`` of the mass, so K starts small and grows until every row's does. Sorting the
    vocabulary takes 300 ms for 64 rows of 49k here; ``topk(64)`` a twentieth of that."""
    vocab = scaled.shape[1]
    full_mass = None
    k = min(
        vocab, max(_FIRST_CANDIDATES, int(top_k[top_k < vocab].max()) if bool((top_k < vocab).any()) else 0)
    )
    while True:
        values, ids = scaled.topk(k, dim=-1)  # sorted, highest first
        values = values.masked_fill(torch.arange(k, device=scaled.device) >= top_k, float("-inf"))
        within_k = top_k <= k  # the row's whole top-k set is here: its normalizer too
        if not bool(within_k.all()) and full_mass is None:
            full_mass = scaled.logsumexp(dim=-1, keepdim=True)
        norm = values.logsumexp(dim=-1, keepdim=True)
        if full_mass is not None:
            norm = torch.where(within_k, norm, full_mass)
        probs = (values - norm).exp()
        fits = within_k | (probs.sum(dim=-1, keepdim=True) >= top_p)
        if k == vocab or bool(fits.all()):
            break
        k = min(vocab, 4 * k)
    keep = ((probs.cumsum(dim=-1) - probs) < top_p) | (top_p >= 1)  # the mass before it is under top_p
    keep &= probs >= min_p * probs[:, :1]
    probs = probs * keep
    return probs / probs.sum(dim=-1, keepdim=True), ids


_DRAW_BLOCK = 256  # the inverse-CDF search picks a block of the vocabulary first, then a token in it


def _draw(weights: torch.Tensor, rows: SamplingRows, index: torch.Tensor) -> torch.Tensor:
    """One inverse-CDF draw per row of ``weights`` (unnormalized probabilities [n, V] of the
    batch's rows ``index``): a uniform from the request's own generator when it is seeded, so
    its tokens do not depend on the batch.

    In two levels, so no pass over the vocabulary is sequential or float64: the block sums
    (256 tokens each, torch's pairwise float32 sum) in a float64 cumulative sum pick the
    block, and a float64 cumulative sum of that block's 256 weights the token. A cumulative
    sum over the whole row was 30 ms of a batch-64 step. A zero-weight token is never drawn:
    the search returns the first cumulative strictly above the target, kept below the total."""
    n, vocab = weights.shape
    uniform = torch.rand(n, 1, device=weights.device, dtype=torch.float64)
    for i, row in enumerate(index.tolist()):
        generator = rows.requests[row].generator
        if generator is not None:
            uniform[i] = torch.rand((), generator=generator, dtype=torch.float64)
    whole = vocab // _DRAW_BLOCK * _DRAW_BLOCK
    sums = [weights[:, :whole].reshape(n, -1, _DRAW_BLOCK).sum(dim=-1)] if whole else []
    if whole < vocab:
        sums.append(weights[:, whole:].sum(dim=-1, keepdim=True))
    cdf = torch.cat(sums, dim=1).double().cumsum(dim=-1)
    target = uniform * cdf[:, -1:]
    block = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    columns = block * _DRAW_BLOCK + torch.arange(_DRAW_BLOCK, device=weights.device)
    inside = columns < vocab
    local = (weights.gather(1, columns.clamp(max=vocab - 1)) * inside).cumsum(dim=-1, dtype=torch.float64)
    rest = torch.minimum(target - before, local[:, -1:] * (1 - 2**-40))  # the two sums' rounding differ
    picked = torch.searchsorted(local, rest, right=True).clamp_(max=_DRAW_BLOCK - 1)
    return (block * _DRAW_BLOCK + picked).squeeze(1)


def _truncated(scaled, top_k, top_p, min_p, rows: SamplingRows, index, need_probs: bool):
    probs, ids = _candidates(scaled, top_k, top_p, min_p)
    tokens = ids.gather(1, _draw(probs, rows, index).unsqueeze(1)).squeeze(1)
    return tokens, torch.zeros_like(scaled).scatter_(1, ids, probs) if need_probs else None


def _untruncated(scaled, top_k, top_p, min_p, rows: SamplingRows, index, need_probs: bool):
    """Over the whole vocabulary: one fused softmax (min-p zeroes what falls below min_p times
    the top probability; the draw needs no renormalizing, its cumulative sum is scaled)."""
    probs = scaled.softmax(dim=-1)
    if bool((min_p > 0).any()):
        probs = probs * (probs >= min_p * probs.amax(dim=-1, keepdim=True))
        if need_probs:
            probs = probs / probs.sum(dim=-1, keepdim=True)
    return _draw(probs, rows, index), probs if need_probs else None


def _random_rows(logits: torch.Tensor, rows: SamplingRows, index: torch.Tensor, need_probs: bool):
    """Tokens for the non-greedy rows ``index`` and, if ``need_probs``, their full
    distributions [n, V] (draft verification reads them). Rows that truncate (top-k, top-p)
    draw among their candidates, the others over the whole vocabulary."""
    if len(index) < logits.shape[0]:
        logits = logits[index]
    temperatures = {rows.temperatures[i] for i in index.tolist()}
    if len(temperatures) == 1:  # one scalar: a broadcast [n, 1] division costs 3x a softmax here
        temperature = temperatures.pop()
        scaled = logits if temperature == 1 else logits / temperature
    else:
        scaled = logits / rows.temperature[index]
    vocab = scaled.shape[1]
    top_k = torch.tensor([k if 0 < k < vocab else vocab for k in rows.top_k], device=logits.device)
    top_k, top_p, min_p = top_k[index].unsqueeze(1), rows.top_p[index], rows.min_p[index]
    truncates = ((top_k < vocab) | (top_p < 1)).squeeze(1)
    if bool(truncates.all()) or not bool(truncates.any()):  # one kind of row: no copies
        draw = _truncated if bool(truncates.any()) else _untruncated
        return draw(scaled, top_k, top_p, min_p, rows, index, need_probs)
    tokens = torch.empty(len(index), dtype=torch.long, device=logits.device)
    probs = torch.zeros_like(scaled) if need_probs else None
    for part, draw in ((truncates, _truncated), (~truncates, _untruncated)):
        tokens[part], part_probs = draw(
            scaled[part], top_k[part], top_p[part], min_p[part], rows, index[part], need_probs
        )
        if need_probs:
            probs[part] = part_probs
    return tokens, probs


def sampling_probs(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """The distribution each non-greedy row samples from [N, V] (greedy rows: their
    temperature-1 distribution under the same truncation)."""
    return _random_rows(logits, rows, torch.arange(logits.shape[0], device=logits.device), True)[1]


def sample(
    logits: torch.Tensor, rows: SamplingRows, need_probs: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (token per row, the sampling distributions when ``need_probs`` and some row
    samples, else None)."""
    if rows.all_greedy:
        return first_max(logits), None
    random_index = (~rows.greedy).nonzero().squeeze(1)
    random_tokens, random_probs = _random_rows(logits, rows, random_index, need_probs)
    if len(random_index) == logits.shape[0]:
        return random_tokens, random_probs
    tokens = first_max(logits)
    tokens[random_index] = random_tokens
    probs = None
    if need_probs:
        probs = logits.softmax(dim=-1)  # greedy rows' are never read (their drafts verify by argmax)
        probs[random_index] = random_probs
    return tokens, probs


def topn_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, n: int) -> list[TokenLogprobs]:
    """Per row: the chosen token first, then the top-n (n = -1: whole vocabulary)."""
    n = logprobs.shape[1] if n == -1 else min(n, logprobs.shape[1])
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))
    ranks = (logprobs > chosen_lp).sum(dim=1) + 1
    top_lp, top_ids = logprobs.topk(n, dim=1) if n else (logprobs[:, :0], chosen[:, None][:, :0])
    ids = torch.cat([chosen.unsqueeze(1), top_ids], dim=1).tolist()
    lps = torch.cat([chosen_lp, top_lp], dim=1).tolist()
    rank_list = ranks.tolist()
    return [
        TokenLogprobs(tuple(i), tuple(lp), (r,) + tuple(range(1, n + 1)))
        for i, lp, r in zip(ids, lps, rank_list)
    ]


def verify_drafts(
    tokens: list[int],
    drafts: Sequence[int],
    probs: torch.Tensor | None,
    request,
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """Exact verification of one request's drafts against its ``len(drafts) + 1`` target rows.

    ``tokens`` are the target's own choice at each row; ``probs`` the target's sampling
    distributions p (None when every row is greedy); ``draft_probs`` the distributions q
    the drafts were drawn from (None: chosen outright, a one-hot q).
    Greedy: keep the longest agreeing prefix plus the target's next token. Sampling:
    accept draft d with probability min(1, p(d) / q(d)); on the first rejection draw from
    the residual max(0, p - q), renormalized; if all are accepted the last row's own
    sample is the bonus token. Either way the output is distributed exactly as p.
    """
    accepted = []
    for i, draft in enumerate(drafts):
        if probs is None or request.sampling_params.greedy:
            if tokens[i] != draft:
                return accepted + [tokens[i]]
        else:
            p = probs[i]
            q = None if draft_probs is None else draft_probs[i].to(p.device, p.dtype)
            q_draft = 1.0 if q is None else float(q[draft])
            u = float(torch.rand((), generator=request.generator))
            if u * q_draft >= float(p[draft]):
                return accepted + [_sample_residual(p, q, draft, request.generator)]
        accepted.append(draft)
    return accepted + [tokens[len(drafts)]]


def _sample_residual(p: torch.Tensor, q: torch.Tensor | None, draft: int, generator) -> int:
    if q is None:
        residual = p.clone()
        residual[draft] = 0
    else:
        residual = (p - q).clamp_min(0)
    if float(residual.sum()) <= 0:  # p == q up to rounding: any draw from p is exact
        residual = p
    noise = torch.empty_like(residual).exponential_(generator=generator)
    return int((residual / noise).argmax())
