"""The plain-torch Mamba2 ops behind :meth:`LayerOps.causal_conv1d` and :meth:`LayerOps.ssm_scan`:
a step's rows belong to many requests, each continuing from the state in its slot (a later
prefill chunk, a decode step) or starting from zero (its first chunk).

Requests decoding one token are updated together, one recurrence step for all; a prefill chunk
runs Mamba2's chunked scan (state space duality) from its slot's state, as ``transformers``'
``mamba2_chunk_scan`` computes it, so a whole prompt here matches it to the last rounding."""

from __future__ import annotations

import itertools
from typing import Any

import attrs
import torch
import torch.nn.functional as F


@attrs.frozen
class StateSpans:
    """Where each request of a step sits: its rows, its state slot, and whether it starts."""

    slots: list[int]
    starts: list[int]
    ends: list[int]
    fresh: list[bool]  # its context starts this step: it reads zero state

    @classmethod
    def of(cls, layout: Any) -> StateSpans:
        """From a state group's :class:`engine.interfaces.BatchLayout`: the slot is each
        request's one block."""
        bounds = list(itertools.accumulate(layout.query_lens, initial=0))
        return cls(
            layout.block_table[:, 0].tolist(),
            bounds[:-1],
            bounds[1:],
            [s == q for s, q in zip(layout.seq_lens_host, layout.query_lens)],
        )

    def singles(self) -> tuple[list[int], list[int]]:
        """(rows, slots) of the requests that compute one row this step."""
        picked = [(a, s) for a, b, s in zip(self.starts, self.ends, self.slots) if b - a == 1]
        return [a for a, _ in picked], [s for _, s in picked]

    def runs(self) -> list[tuple[int, int, int]]:
        """(first row, end row, slot) of the requests that compute more than one row."""
        return [(a, b, s) for a, b, s in zip(self.starts, self.ends, self.slots) if b - a > 1]

    def zero_fresh(self, states: torch.Tensor) -> None:
        """Clear the slots of the requests that start this step (a slot keeps whatever its
        last owner left)."""
        fresh = [s for s, f in zip(self.slots, self.fresh) if f]
        if fresh:
            states[fresh] = 0


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, states: torch.Tensor, layout: Any
) -> torch.Tensor:
    """silu(causal depthwise conv(x)): x [T, C] (rows of many requests), weight [C, K], each
    request continuing from its slot's last K-1 inputs ``states`` [slots, C, K-1] (float32),
    which are replaced by the K-1 inputs ending its rows. -> [T, C] in x's dtype."""
    spans = StateSpans.of(layout)
    spans.zero_fresh(states)
    out = torch.empty_like(x)
    rows, slots = spans.singles()
    if rows:
        window = torch.cat([states[slots], x[rows, :, None].float()], dim=-1)  # [n, C, K]
        out[rows] = _biased((window * weight.float()).sum(-1), bias).to(x.dtype)
        states[slots] = window[:, :, 1:]
    for start, end, slot in spans.runs():
        window = torch.cat([states[slot], x[start:end].T.float()], dim=-1)  # [C, K-1+n]
        conv = (window.unfold(1, weight.shape[1], 1) * weight.float()[:, None]).sum(-1)  # [C, n]
        out[start:end] = _biased(conv.T, bias).to(x.dtype)
        states[slot] = window[:, window.shape[1] - states.shape[-1] :]
    return F.silu(out)


def _biased(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x if bias is None else x + bias.float()


@attrs.frozen
class SSMParams:
    """A Mamba2 layer's input-independent SSM parameters: ``A`` [H] (negative: ``-exp(A_log)``),
    the skip ``D`` [H], ``dt_bias`` [H], the range ``dt`` is clamped to after softplus, and the
    chunk length of the chunked scan."""

    A: torch.Tensor
    D: torch.Tensor
    dt_bias: torch.Tensor
    dt_limit: tuple[float, float]
    chunk_size: int


def ssm_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    params: SSMParams,
    states: torch.Tensor,
    layout: Any,
) -> torch.Tensor:
    """The selective scan: x [T, H, P], dt [T, H] (before dt_bias and softplus), B and C
    [T, G, N] (G groups of heads) -> y [T, H, P] in x's dtype, each request continuing from its
    slot's SSM state ``states`` [slots, H, P, N] (float32), which ends as the state after its
    last row."""
    spans = StateSpans.of(layout)
    spans.zero_fresh(states)
    heads = x.shape[1]
    dt = F.softplus(dt.float() + params.dt_bias.float()).clamp(*params.dt_limit)
    B = B.float().repeat_interleave(heads // B.shape[1], dim=1)
    C = C.float().repeat_interleave(heads // C.shape[1], dim=1)
    A, xf = params.A.float(), x.float()
    y = torch.empty_like(xf)
    rows, slots = spans.singles()
    if rows:
        state = states[slots] * torch.exp(dt[rows] * A)[..., None, None]
        state += (dt[rows, :, None] * xf[rows])[..., None] * B[rows, :, None, :]
        y[rows] = (state @ C[rows, :, :, None])[..., 0]
        states[slots] = state
    for start, end, slot in spans.runs():
        part = slice(start, end)
        y[part], states[slot] = _chunked_scan(xf[part], dt[part], A, B[part], C[part], states[slot], params)
    return (y + params.D.float()[:, None] * xf).to(x.dtype)


def _chunked_scan(x, dt, A, B, C, initial, params: SSMParams) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's rows x [L, H, P], dt [L, H], B, C [L, H, N] from state ``initial``
    [H, P, N] -> (y [L, H, P] without the D skip, the final state): ``transformers``'
    ``mamba2_chunk_scan`` (its einsum letters: c chunk, l and s positions in it, h head,
    p head dim, n state)."""
    length, chunk = x.shape[0], params.chunk_size
    pad = (chunk - length % chunk) % chunk
    x, A = x * dt[..., None], A * dt  # discretized
    x, A, B, C = (
        F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)).reshape(-1, chunk, *t.shape[1:]) for t in (x, A, B, C)
    )
    A = A.permute(2, 0, 1)  # [h, c, l]
    A_cumsum = torch.cumsum(A, dim=-1)
    decay = torch.exp(_segment_sum(A))  # [h, c, l, s]
    y_diag = torch.einsum("clhn,cshn,hcls,cshp->clhp", C, B, decay, x)
    decay_states = torch.exp(A_cumsum[:, :, -1:] - A_cumsum)  # [h, c, l]
    chunk_states = torch.einsum("clhn,hcl,clhp->chpn", B, decay_states, x)
    chunk_states = torch.cat([initial[None], chunk_states])  # [c + 1, h, p, n]
    decay_chunk = torch.exp(_segment_sum(F.pad(A_cumsum[:, :, -1], (1, 0))))  # [h, c + 1, c + 1]
    new_states = torch.einsum("hzc,chpn->zhpn", decay_chunk, chunk_states)
    starts, final = new_states[:-1], new_states[-1]
    y_off = torch.einsum("clhn,chpn,hcl->clhp", C, starts, torch.exp(A_cumsum))
    return (y_diag + y_off).reshape(-1, *x.shape[2:])[:length], final


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: out[i, j] = sum of x[j + 1 .. i] below the diagonal, 0 on it,
    -inf above (``transformers``' stable segment sum)."""
    length = x.shape[-1]
    x = x[..., None].expand(*x.shape, length)
    below = torch.tril(torch.ones(length, length, dtype=torch.bool, device=x.device), diagonal=-1)
    sums = torch.cumsum(x.masked_fill(~below, 0), dim=-2)
    keep = torch.tril(torch.ones(length, length, dtype=torch.bool, device=x.device), diagonal=0)
    return sums.masked_fill(~keep, -torch.inf)
