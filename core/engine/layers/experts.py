"""Rows sorted by expert (:class:`ExpertSegments`) and the grouped matmul over them: what a
mixture-of-experts layer (:mod:`engine.layers.moe`) and a quant method's ``apply_moe`` share."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F


@attrs.frozen
class ExpertSegments:
    """Rows sorted by expert: ``sizes[e]`` rows of local expert ``e``, in expert order.
    ``offsets`` is their running end (int32), the form ``torch._grouped_mm`` takes."""

    sizes: list[int]
    offsets: torch.Tensor

    @classmethod
    def from_counts(cls, counts: torch.Tensor) -> ExpertSegments:
        return cls(counts.tolist(), counts.cumsum(0).to(torch.int32))

    @classmethod
    def single(cls, expert: int, rows: int, num_experts: int) -> ExpertSegments:
        """``rows`` rows, all of ``expert``."""
        counts = torch.zeros(num_experts, dtype=torch.long)
        counts[expert] = rows
        return cls.from_counts(counts)

    def expert_of_rows(self, device) -> torch.Tensor:
        """The local expert of each row, int64 [M] (to gather per-expert biases)."""
        sizes = torch.tensor(self.sizes, device=device)
        return torch.repeat_interleave(torch.arange(len(self.sizes), device=device), sizes)

    def per_expert(
        self, x: torch.Tensor, out_features: int, matmul: Callable[[int, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``matmul(expert, rows)`` over each expert's segment of ``x`` [M, in] -> [M, out]:
        the loop over the experts that received rows, for kernels that take one weight."""
        out = x.new_empty(x.shape[0], out_features)
        start = 0
        for expert, size in enumerate(self.sizes):
            if size:
                out[start : start + size] = matmul(expert, x[start : start + size])
                start += size
        return out


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, segments: ExpertSegments) -> torch.Tensor:
    """x [M, K] sorted by expert, weight [E, N, K] -> [M, N]: each segment times its expert's
    weight transposed, in one ``torch._grouped_mm`` call where torch has it for the CPU (it
    splits the rows itself and skips empty experts), else a loop over the experts with rows."""
    if _grouped_mm_takes(x, weight):
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=segments.offsets)
    return segments.per_expert(x, weight.shape[1], lambda expert, rows: F.linear(rows, weight[expert]))


def _grouped_mm_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs these operands: on the CPU, contiguous, rows of
    whole 16-byte lines (it refuses other strides), at least one row."""
    return (
        x.device.type == "cpu"
        and hasattr(torch, "_grouped_mm")
        and x.shape[0] > 0
        and x.is_contiguous()
        and weight.is_contiguous()
        and x.shape[1] * x.element_size() % 16 == 0
        and weight.shape[1] * weight.element_size() % 16 == 0
    )
