"""Positions of a model whose tokens carry several position axes (``Model.position_axes`` > 1,
models v5: Qwen2-VL's M-RoPE). The model says a prompt's positions once per request
(``Model.prompt_positions``, from its tokens and images) and the offset every later token adds to
its index; each step takes the rows of the tokens it computes. Generated tokens (and drafts)
continue from the prompt's largest position + 1, as ``transformers``' ``rope_deltas`` do, so a
prompt recomputed after preemption, output tokens included, gets the positions it had."""

from __future__ import annotations

from weakref import WeakKeyDictionary

import torch

from engine.messages.step import StepPlan


class AxisPositions:
    def __init__(self, model, device):
        self.model, self.device = model, device
        # per request (while it lives): its prompt's positions [axes, P] and the later offset
        self._prompts: WeakKeyDictionary = WeakKeyDictionary()

    def step_positions(self, plan: StepPlan, spans, token_positions: torch.Tensor) -> torch.Tensor:
        """The step's positions [axes, T]: ``token_positions`` [T] are the rows' token indices,
        ``spans`` each scheduled request's (id, first row, end row)."""
        pieces = []
        for item, (_, first, end) in zip(plan.scheduled, spans):
            prompt, offset = self._prompt(item.request)
            index = token_positions[first:end]
            in_prompt = index < prompt.shape[1]
            taken = prompt[:, index.clamp(max=prompt.shape[1] - 1)]
            pieces.append(torch.where(in_prompt, taken, index + offset))
        return torch.cat(pieces, dim=1)

    def _prompt(self, request) -> tuple[torch.Tensor, int]:
        known = self._prompts.get(request)
        if known is None:
            positions, offset = self.model.prompt_positions(request.prompt_token_ids, request.mm_items)
            if positions.shape != (self.model.position_axes, len(request.prompt_token_ids)):
                raise ValueError(
                    f"{type(self.model).__name__}.prompt_positions returned {tuple(positions.shape)} for a "
                    f"{len(request.prompt_token_ids)}-token prompt of {self.model.position_axes} axes"
                )
            known = self._prompts[request] = (positions.to(self.device, torch.long), int(offset))
        return known
