"""A step's encoder budget: the image tokens it may encode (vLLM's
``max_num_encoder_input_tokens``; default ``max_num_batched_tokens``).

The runner encodes a whole image the first step that computes any of its rows
(:mod:`engine.runner.encoder_cache`), so a step that reaches many new images at once would
run the encoder over all of them on top of its token budget. The scheduler charges each image
to the step whose rows first reach it, an image's whole length, and cuts a request's chunk
just before the first image that no longer fits (it comes next step, or waits when it starts
the chunk). An image charged once is not charged again for the request until it is preempted
(its later chunks read the encoder cache); one reached again after preemption is charged
again, as it may have been evicted. An image longer than the whole budget is encoded in a
step that encodes nothing else (vLLM's budget is at least the longest item's tokens)."""

from __future__ import annotations

import attrs

from engine.messages.request import Request


@attrs.frozen
class EncoderCharge:
    """What scheduling ``num_new`` tokens of a request costs: ``tokens`` of images first
    reached, all of them before position ``upto``."""

    num_new: int
    tokens: int = 0
    upto: int = 0


class EncoderBudget:
    def __init__(self, limit: int):
        self.limit = limit
        self.left = limit
        self._charged: dict[str, int] = {}  # request id -> the end of the last image charged

    def begin(self) -> None:
        """A new step: the whole budget again."""
        self.left = self.limit

    def fit(self, request: Request, start: int, num_new: int) -> EncoderCharge:
        """``num_new`` tokens from position ``start``, cut before the first image not yet
        charged for the request that the step's budget no longer holds."""
        if not request.mm_items:
            return EncoderCharge(num_new)
        charged_upto = self._charged.get(request.request_id, 0)
        tokens, upto, end = 0, charged_upto, start + num_new
        for item in sorted(request.mm_items, key=lambda i: i.offset):
            if item.end <= max(start, charged_upto) or item.offset >= end:
                continue
            alone = tokens == 0 and self.left == self.limit  # vLLM's budget is at least one item
            if tokens + item.length > self.left and not alone:
                return EncoderCharge(max(0, item.offset - start), tokens, upto)
            tokens, upto = tokens + item.length, item.end
        return EncoderCharge(num_new, tokens, upto)

    def charge(self, request: Request, charge: EncoderCharge) -> None:
        """The request was scheduled as ``charge`` says."""
        if charge.tokens:
            self.left -= charge.tokens
            self._charged[request.request_id] = charge.upto

    def forget(self, request_id: str) -> None:
        """The request was preempted (its images may need encoding again) or finished."""
        self._charged.pop(request_id, None)
