"""Step fault isolation: when executing a step raises, find the request that causes it.

The step's requests are re-run one at a time. What a failed execution leaves behind is
safe to repeat: K/V writes land in the same slots with the same values, the scheduler
is updated only after execution, and a grammar's bitmask is only read (drafts it
accepts are rolled back). A request that fails alone is a culprit and is finished with
an error; the others keep the results of their own run, which are what the batch would
have given them: greedy rows by the batch invariance the parity tests check, seeded rows
because each draws from its own generator — exactly, when the fault struck before the
draw (the forward, a logits processor, a grammar mask: every seam that sees request data
before sampling). No generator state is copied per step to keep the hot path free, so a
fault after the draw (draft verification) would shift seeded survivors by one draw.

Two outcomes stay fatal (the original exception is re-raised): no request fails alone
(the fault is the batch's, not a request's), and every request fails alone while a
probe — a one-token request that writes only the null block, greedy or, on a pooling
engine, pooling as the step's requests do — fails too (the fault is the engine's or a
plugin's, e.g. a logits processor that raises on every call).

A model with state layers (Mamba) is not isolated: its layers update each request's state in
place as they run, so a failed run is not safe to repeat, and the engine re-raises (fatal).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from engine.messages.pooling_params import PoolingParams
from engine.messages.request import Request
from engine.messages.sampling_params import SamplingParams
from engine.messages.step import ScheduledRequest, StepPlan, StepResult

NULL_BLOCK = 0  # the KV cache manager interface keeps block 0 out of every request's table
MAX_MESSAGE = 200

Run = Callable[[StepPlan, list[list[int]] | None], StepResult]  # (plan, block tables; None: the requests')


@attrs.frozen
class Isolated:
    plan: StepPlan  # the step without its culprits
    result: StepResult  # the survivors' results, each from its own run
    culprits: list[tuple[Request, Exception]]


def isolate(plan: StepPlan, run: Run, error: Exception) -> Isolated:
    survivors, results, culprits = [], [], []
    for item in plan.scheduled:
        try:
            results.append(run(StepPlan((item,)), None))
            survivors.append(item)
        except Exception as exc:  # noqa: BLE001 - any exception: that is what isolation attributes
            culprits.append((item.request, exc))
    if not culprits or (not survivors and not _probe_runs(run, plan)):
        raise error
    return Isolated(StepPlan(tuple(survivors), plan.preempted), merge(results), culprits)


def _probe_runs(run: Run, plan: StepPlan) -> bool:
    pools = plan.scheduled[0].request.pooling_params is not None  # an engine runs one kind of request
    params = PoolingParams() if pools else SamplingParams(temperature=0.0, max_tokens=1)
    probe = Request("engine-fault-probe", [0], params)
    try:
        run(StepPlan((ScheduledRequest(probe, 1),)), [[NULL_BLOCK]])
    except Exception:  # noqa: BLE001
        return False
    return True


def merge(results: list[StepResult]) -> StepResult:
    merged = StepResult({})
    for result in results:
        for name in ("sampled", "logprobs", "prompt_logprobs", "hidden_states", "pooled"):
            getattr(merged, name).update(getattr(result, name))
    return merged


def error_message(exc: Exception) -> str:
    """What the culprit's client is told: the exception's type and (short) message."""
    text = f"{type(exc).__name__}: {exc}"
    if len(text) > MAX_MESSAGE:
        text = text[: MAX_MESSAGE - 3] + "..."
    return f"the engine failed on this request ({text})"
