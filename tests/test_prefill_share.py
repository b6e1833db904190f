"""The prefill share: while a request decodes, a long prompt's chunks are sized to the step
time target, learned from the steps as they run; alone, a prompt gets the whole budget."""

import time

from engine.builtin.chunking import FIRST_SHARE, MIN_SHARE, PrefillShare
from engine.config import EngineConfig
from engine.core.lifecycle import request_path
from engine.messages.request import Request
from engine.messages.sampling_params import SamplingParams
from engine.messages.step import StepResult
from engine.plugins import load_plugins


def test_share_shrinks_after_a_slow_step_and_grows_after_a_fast_one():
    share = PrefillShare(target_s=0.05, budget=2048)
    share.begin(decoding=True)
    assert share.take(5000) == FIRST_SHARE and share.take(10) == 0  # the share, then nothing
    time.sleep(0.2)  # four times the target
    share.end()
    assert share.tokens == MIN_SHARE  # 32 x 1/4, never under the floor
    share.target_s = 10.0
    for expected in (32, 64, 128):  # a fast step that used its whole share: at most x2
        share.begin(decoding=True)
        assert share.take(4096) == share.tokens
        share.end()
        assert share.tokens == expected


def test_share_learns_nothing_from_a_fast_step_it_did_not_bound():
    share = PrefillShare(target_s=10.0, budget=2048)
    share.begin(decoding=True)
    share.take(10)  # the prompt's last 10 tokens: under the share
    share.end()
    assert share.tokens == FIRST_SHARE


def test_no_stream_waiting_means_the_whole_budget():
    share = PrefillShare(target_s=0.05, budget=2048)
    share.begin(decoding=False)
    assert share.take(5000) == 2048
    time.sleep(0.1)
    share.end()
    assert share.tokens == FIRST_SHARE  # a step without decode rows teaches nothing


def _scheduler(**options):
    """The default scheduler's request path (the core applies each step's result)."""
    config = EngineConfig.from_kwargs(block_size=16, max_num_batched_tokens=512, **options)
    kv = load_plugins().get("kv_cache_managers", "default")(config, 200)
    return request_path(load_plugins(), config, kv, None, 199 * 16)


def _step(scheduler):
    plan = scheduler.schedule()
    scheduler.apply(
        plan, StepResult({item.request.request_id: [7] for item in plan.scheduled if item.samples})
    )
    return {item.request.request_id: item.num_new_tokens for item in plan.scheduled}


def test_a_long_prompt_beside_a_stream_gets_the_share_and_alone_the_budget():
    scheduler = _scheduler(shared_step_target_s=30.0)  # every step is fast: the share only grows
    scheduler.add(Request("stream", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True)))
    assert _step(scheduler) == {"stream": 3}
    scheduler.add(Request("long", [5] * 3000, SamplingParams(max_tokens=1)))
    chunks = [_step(scheduler) for _ in range(4)]
    assert chunks == [{"stream": 1, "long": n} for n in (32, 64, 128, 256)]
    alone = _scheduler()
    alone.add(Request("long", [5] * 3000, SamplingParams(max_tokens=1)))
    assert _step(alone) == {"long": 512}


def test_target_zero_turns_the_share_off():
    scheduler = _scheduler(shared_step_target_s=0)
    scheduler.add(Request("stream", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True)))
    _step(scheduler)
    scheduler.add(Request("long", [5] * 3000, SamplingParams(max_tokens=1)))
    assert _step(scheduler) == {"stream": 1, "long": 511}
