"""How far a configuration's next-token distributions are from a reference's, the way
llama.cpp's ``--kl-divergence`` measures a quantized file: teacher-forced over a held text, the
mean KL divergence KL(reference ‖ tested) per position and the top-1 agreement.

Teacher forcing runs as decoding does: each window's prompt is prefilled, then every following
token of the window is *forced* as the sampled one, so each scored position is a decode step
(batched over the windows) through the same kernels a generation takes. The forcing is a
logits processor (:data:`FORCING`, registered in-process by this module), so build the engine
with ``logits_processors=[FORCING]`` and an in-process client (``LLM``)::

    from engine.testing import divergence

    windows = divergence.held_windows(llm.get_tokenizer(), count=8, prompt_len=32, length=128)
    ref = divergence.forced_logprobs(LLM(path, dtype="float32", quantization="unquantized",
                                         logits_processors=[divergence.FORCING]), windows)
    test = divergence.forced_logprobs(LLM(path, logits_processors=[divergence.FORCING]), windows)
    print(divergence.compare(ref, test))
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import attrs
import torch

from engine import hookimpl
from engine.interfaces import LogitsProcessor
from engine.plugins import add_plugin

FORCING = "teacher-forcing"
Window = tuple[list[int], list[int]]  # (prompt ids, the ids forced after it)


class TeacherForcing(LogitsProcessor):
    """Records each forced request's log-probabilities (float32, whole vocabulary) and then
    allows only the window's next token, so greedy and sampled requests alike take it."""

    recorded: dict[str, list[torch.Tensor]] = {}
    lock = threading.Lock()

    def apply(self, logits, requests):
        for row, request in enumerate(requests):
            forced = (request.sampling_params.extra_args or {}).get(FORCING)
            if forced is None:
                continue
            key, targets = forced
            with self.lock:
                self.recorded.setdefault(key, []).append(logits[row].float().log_softmax(-1))
            target = targets[len(request.output_token_ids)]
            logits[row] = float("-inf")
            logits[row, target] = 0.0
        return logits


class _Plugin:
    @staticmethod
    @hookimpl
    def register_logits_processors(register):
        register(FORCING, TeacherForcing, api=1)


add_plugin(_Plugin, FORCING)


def forced_logprobs(llm, windows: Sequence[Window]) -> list[torch.Tensor]:
    """Per window, [len(forced), vocab] log-probabilities the engine gave each forced token's
    position, all windows in one batch. ``llm`` must run the :data:`FORCING` processor."""
    from engine import SamplingParams

    keys = [f"{id(windows)}-{i}" for i in range(len(windows))]
    params = [
        SamplingParams(
            max_tokens=len(forced), temperature=0, ignore_eos=True, extra_args={FORCING: (key, forced)}
        )
        for key, (_, forced) in zip(keys, windows)
    ]
    prompts = [{"prompt_token_ids": prompt} for prompt, _ in windows]
    llm.generate(prompts, params, use_tqdm=False)
    with TeacherForcing.lock:
        rows = [TeacherForcing.recorded.pop(key, []) for key in keys]
    if any(len(r) != len(f) for r, (_, f) in zip(rows, windows)):
        raise RuntimeError(f"the engine did not run the {FORCING!r} logits processor on every step")
    return [torch.stack(r) for r in rows]


@attrs.frozen
class Divergence:
    """KL(reference ‖ tested) per position in nats: mean, median, 99th percentile, max; and the
    share of positions whose most likely token is the same."""

    positions: int
    mean_kl: float
    median_kl: float
    p99_kl: float
    max_kl: float
    top1: float

    def __str__(self) -> str:
        return (
            f"mean KL {self.mean_kl:.5f}  median {self.median_kl:.5f}  p99 {self.p99_kl:.4f}  "
            f"max {self.max_kl:.3f}  top-1 {100 * self.top1:.2f}%  ({self.positions} positions)"
        )


def compare(reference: Sequence[torch.Tensor], tested: Sequence[torch.Tensor]) -> Divergence:
    """The divergence of ``tested`` from ``reference`` (log-probabilities, window by window;
    a narrower vocabulary is compared on its ids, the reference's padding left out)."""
    kl, agree = [], []
    for p, q in zip(reference, tested, strict=True):
        width = min(p.shape[-1], q.shape[-1])
        p, q = p[:, :width].log_softmax(-1), q[:, :width].log_softmax(-1)
        kl.append((p.exp() * (p - q)).sum(-1))
        agree.append(p.argmax(-1) == q.argmax(-1))
    kls = torch.cat(kl).double()
    return Divergence(
        positions=kls.numel(),
        mean_kl=kls.mean().item(),
        median_kl=kls.median().item(),
        p99_kl=kls.quantile(0.99).item(),
        max_kl=kls.max().item(),
        top1=torch.cat(agree).double().mean().item(),
    )


def held_text() -> str:
    """English prose every Python ships and no model card trains on by name: the language
    reference's topics (``pydoc_data``), in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def held_windows(tokenizer, count: int, prompt_len: int, length: int, skip: int = 1000) -> list[Window]:
    """``count`` consecutive windows of the held text's tokens: ``prompt_len`` prompt ids, then
    ``length`` ids to force (the first ``skip`` tokens, the text's opening, left out)."""
    ids = tokenizer.encode(held_text())
    size = prompt_len + length
    if skip + count * size > len(ids):
        raise ValueError(f"the held text has {len(ids)} tokens; {count} windows of {size} need more")
    starts = [skip + i * size for i in range(count)]
    return [(ids[s : s + prompt_len], ids[s + prompt_len : s + size]) for s in starts]
