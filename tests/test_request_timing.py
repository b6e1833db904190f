"""Per-request phase times measured in the engine core (queue: added -> first scheduled;
prefill: first scheduled -> first token), sent once with the first token, and the
tokens-per-step histogram the core keeps in its stats."""

from __future__ import annotations

from engine import SamplingParams
from engine.core.step_stats import StepTokenHistogram, step_token_buckets
from engine.messages.request import Request


def run(engine, requests: list[Request]):
    for request in requests:
        engine.add_request(request)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs


def test_timing_comes_once_with_the_first_token(tiny_llm):
    engine = tiny_llm.engine
    before = engine.stats()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = run(engine, [Request(f"timing-{i}", [1, 2, 3, 4 + i], params) for i in range(3)])
    for i in range(3):
        mine = [o for o in outputs if o.request_id == f"timing-{i}"]
        assert sum(len(o.new_token_ids) for o in mine) == 4
        timed = [o for o in mine if o.timing is not None]
        assert timed == [mine[0]] and mine[0].new_token_ids
        assert timed[0].timing.queue >= 0 and timed[0].timing.prefill > 0
    after = engine.stats()
    # 3 prompts of 4 tokens, then 3 decoding requests: 3 fed-back tokens each
    assert after["iteration_tokens_sum"] - before["iteration_tokens_sum"] == 3 * 4 + 3 * 3
    assert after["iteration_tokens_count"] - before["iteration_tokens_count"] == 4


def test_step_token_histogram_is_cumulative():
    histogram = StepTokenHistogram((1, 8, 16))
    for tokens in (1, 5, 8, 9, 100):
        histogram.observe(tokens)
    stats = histogram.stats()
    assert step_token_buckets(stats) == [("1", 1), ("8", 3), ("16", 4), ("+Inf", 5)]
    assert stats["iteration_tokens_sum"] == 123 and stats["iteration_tokens_count"] == 5
