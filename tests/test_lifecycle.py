"""The core's request lifecycle (engine.core.lifecycle): applying a step's result — computed
tokens, appended tokens, the grammar advanced, token-level stop rules, finishing and freeing,
outputs — around the default scheduler, with a stand-in for the model's sampled tokens."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.core.lifecycle import RequestLifecycle, request_path
from engine.interfaces import Grammar, RequestStatus
from engine.messages.pooling_params import PoolingParams
from engine.messages.request import Request
from engine.messages.sampling_params import SamplingParams
from engine.messages.step import StepResult, TokenLogprobs
from engine.plugins import load_plugins

BLOCKS = 32


def lifecycle(max_model_len: int = 120, **options) -> RequestLifecycle:
    config = EngineConfig.from_kwargs(**{"block_size": 4, "max_num_batched_tokens": 64, **options})
    kv = load_plugins().get("kv_cache_managers", "default")(config, BLOCKS)
    return request_path(load_plugins(), config, kv, None, max_model_len)


def step(path: RequestLifecycle, tokens: dict[str, list[int]], **result):
    """Schedule, then apply ``tokens`` as sampled for the requests that sample this step."""
    plan = path.schedule()
    sampled = {i.request.request_id: tokens[i.request.request_id] for i in plan.scheduled if i.samples}
    return plan, {o.request_id: o for o in path.apply(plan, StepResult(sampled, **result))}


def free_blocks(path: RequestLifecycle) -> int:
    return path.kv.kv.num_free_blocks


def test_stop_rules_eos_stop_token_min_tokens_and_length():
    path = lifecycle()
    eos = Request("eos", [1, 2, 3], SamplingParams(max_tokens=9), eos_token_id=7)
    early = Request("early", [1, 2, 3], SamplingParams(max_tokens=9, min_tokens=2), eos_token_id=7)
    stop = Request("stop", [1, 2, 3], SamplingParams(max_tokens=9, stop_token_ids=[5]))
    length = Request("length", [1, 2, 3], SamplingParams(max_tokens=2))
    for request in (eos, early, stop, length):
        path.add(request)
    _, outs = step(path, {"eos": [7], "early": [7], "stop": [5], "length": [4]})
    assert (outs["eos"].finish_reason, outs["eos"].new_token_ids) == ("stop", [7])
    assert outs["early"].finish_reason is None  # EOS before min_tokens does not stop
    assert (outs["stop"].finish_reason, outs["stop"].stop_reason) == ("stop", 5)
    assert outs["length"].finish_reason is None
    _, outs = step(path, {"early": [7], "length": [4]})
    assert outs["early"].finish_reason == "stop" and outs["length"].finish_reason == "length"
    assert not path.has_unfinished() and free_blocks(path) == BLOCKS - 1


def test_the_model_length_stops_a_request():
    path = lifecycle(max_model_len=5)
    path.add(Request("r", [1, 2, 3], SamplingParams(max_tokens=50)))
    step(path, {"r": [4]})
    _, outs = step(path, {"r": [4]})
    assert outs["r"].finish_reason == "length" and len(outs["r"].new_token_ids) == 1


def test_accepted_drafts_count_as_computed_and_stop_mid_way():
    path = lifecycle()
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=20, stop_token_ids=[9]))
    path.add(request)
    step(path, {"r": [4]})
    request.spec_token_ids = [5, 6, 9, 8]  # as the speculator leaves them
    assert path.reserve_lookahead(request, 4)
    plan, outs = step(path, {"r": [5, 6, 9, 8, 1]})  # three drafts accepted, then the stop token
    assert plan.scheduled[0].spec_token_ids == (5, 6, 9, 8)
    assert outs["r"].new_token_ids == [5, 6, 9] and outs["r"].finish_reason == "stop"
    assert request.output_token_ids == [4, 5, 6, 9] and request.spec_token_ids == []


def test_a_request_aborted_while_its_step_ran_gets_no_output():
    path = lifecycle()
    path.add(Request("gone", [1, 2, 3], SamplingParams(max_tokens=5)))
    path.add(Request("kept", [1, 2, 3], SamplingParams(max_tokens=5)))
    plan = path.schedule()
    path.abort(["gone"])
    outs = path.apply(plan, StepResult({"gone": [4], "kept": [4]}))
    assert [o.request_id for o in outs] == ["kept"]
    assert [i.request.request_id for i in path.schedule().scheduled] == ["kept"]


def test_pooled_requests_finish_with_their_vector():
    path = lifecycle()
    path.add(Request("p", [1, 2, 3], PoolingParams()))
    vector = torch.ones(4)
    _, outs = step(path, {}, pooled={"p": vector})
    assert outs["p"].finish_reason == "stop" and outs["p"].pooled is vector
    assert not path.has_unfinished() and free_blocks(path) == BLOCKS - 1


def test_prompt_logprobs_of_a_chunk_that_samples_nothing():
    path = lifecycle(max_num_batched_tokens=4)
    path.add(Request("r", list(range(1, 10)), SamplingParams(max_tokens=1, prompt_logprobs=0)))
    first = [TokenLogprobs((2,), (-0.5,), (1,))]
    _, outs = step(path, {}, prompt_logprobs={"r": first})
    assert outs["r"].new_token_ids == [] and outs["r"].new_prompt_logprobs == first


class RefusingGrammar(Grammar):
    """A grammar whose state disagrees with the mask it gave: it refuses the second token."""

    def __init__(self):
        self.accepted = 0

    def accept_tokens(self, token_ids):
        self.accepted += len(token_ids)
        return self.accepted < 2

    def fill_bitmask(self, bitmask, row):
        pass

    def rollback(self, num_tokens):
        self.accepted -= num_tokens

    def is_terminated(self):
        return False

    def reset(self):
        self.accepted = 0


def test_a_grammar_that_refuses_a_sampled_token_fails_only_its_request(caplog):
    path = lifecycle()
    broken = Request("broken", [1, 2, 3], SamplingParams(max_tokens=5))
    broken.grammar = RefusingGrammar()
    path.add(broken)
    path.add(Request("other", [1, 2, 3], SamplingParams(max_tokens=5)))
    step(path, {"broken": [4], "other": [4]})
    _, outs = step(path, {"broken": [6], "other": [4]})
    assert outs["broken"].finish_reason == "error" and outs["broken"].new_token_ids == []
    assert "refused token 6" in outs["broken"].error and "refused token 6" in caplog.text
    assert broken.output_token_ids == [4] and broken.status is RequestStatus.FINISHED
    assert outs["other"].finish_reason is None and path.has_unfinished()


def test_a_terminated_grammar_stops_the_request():
    class Done(RefusingGrammar):
        def accept_tokens(self, token_ids):
            return True

        def is_terminated(self):
            return True

    path = lifecycle()
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=5))
    request.grammar = Done()
    path.add(request)
    _, outs = step(path, {"r": [4]})
    assert outs["r"].finish_reason == "stop"


def test_refused_requests_finish_and_preempted_ones_lose_their_drafts():
    path = lifecycle(max_queue_wait=1e-9)
    late = Request("late", [1, 2, 3], SamplingParams(max_tokens=5))
    path.add(late)
    plan = path.schedule()
    assert plan.refused == ("late",) and not plan.scheduled
    assert late.finish_reason == "error" and not path.has_unfinished()

    small = lifecycle(max_model_len=100, max_num_batched_tokens=8)
    long_a = Request("a", list(range(1, 40)), SamplingParams(max_tokens=30, ignore_eos=True))
    long_b = Request("b", list(range(2, 41)), SamplingParams(max_tokens=30, ignore_eos=True))
    small.add(long_a)
    small.add(long_b)
    for _ in range(200):
        plan = small.schedule()
        if plan.preempted:
            break
        small.apply(plan, StepResult({i.request.request_id: [3] for i in plan.scheduled if i.samples}))
        for request in small.running(plan):
            request.spec_token_ids = [1]  # as the speculator leaves them
    assert plan.preempted, "the pool was meant to run out"
    victim = small.requests[plan.preempted[0]]
    assert victim.spec_token_ids == [] and victim.status is RequestStatus.PREEMPTED


class EndsAtTwo(RefusingGrammar):
    """Accepts anything; token 2 is its EOS; asking a terminated grammar for a mask is a bug."""

    def __init__(self):
        self.tokens = []

    def accept_tokens(self, token_ids):
        if self.is_terminated():
            return False
        self.tokens += token_ids
        return True

    def fill_bitmask(self, bitmask, row):
        assert not self.is_terminated(), "a terminated grammar was asked for a mask"
        bitmask[row] = 0b1111

    def rollback(self, num_tokens):
        del self.tokens[len(self.tokens) - num_tokens :]

    def is_terminated(self):
        return 2 in self.tokens


def test_bitmask_rows_after_a_draft_eos_stay_all_allowed():
    from engine.core.structured import StructuredOutputs
    from engine.interfaces import GrammarBackend, GrammarContext, ScheduledRequest, StepPlan

    class Backend(GrammarBackend):
        def compile(self, spec):
            return EndsAtTwo()

    structured = StructuredOutputs({"test": Backend}, GrammarContext(None, 64))
    request = Request("r", [1, 3], SamplingParams(max_tokens=5))
    request.grammar = EndsAtTwo()
    mask = structured.bitmask(StepPlan((ScheduledRequest(request, 2, (5, 2, 7)),)))
    assert mask[:2].eq(0b1111).all() and mask[2:].eq(-1).all()  # before 5, before 2; then after EOS
    assert request.grammar.tokens == []  # rolled back
    structured.shutdown()


def test_a_burst_of_decode_steps_runs_only_when_every_request_decodes():
    """``with_burst``: while every unfinished request is in the plan decoding one token
    greedily, the plan may run that many steps in a row, cut to what ``max_tokens`` and the
    model's length leave, with slots for them; a request still prefilling or waiting keeps it to
    one step, and so does a sampled one (it could not run it)."""
    path = lifecycle(max_model_len=40)
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=20, temperature=0))
    b = Request("b", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3, temperature=0))
    path.add(a)
    prefill = path.schedule()
    assert path.with_burst(prefill, 4).decode_burst == 1  # a prompt step
    path.apply(prefill, StepResult({"a": [6]}))
    path.add(b)  # waiting: not in the next plan's decode alone
    plan = path.schedule()
    assert {i.request.request_id for i in plan.scheduled} == {"a", "b"}
    assert path.with_burst(plan, 4).decode_burst == 1  # b prefills
    path.apply(plan, StepResult({"a": [7], "b": [8]}))
    plan = path.with_burst(path.schedule(), 4)
    assert plan.decode_burst == 2  # b may make 2 more of its 3 tokens
    table = path.kv.kv.group_block_ids(a)[0]
    assert len(table) * 4 >= a.num_tokens - 1 + 2  # slots for both steps' positions
    outs = {o.request_id: o for o in path.apply(plan, StepResult({"a": [9, 10], "b": [11, 12]}))}
    assert outs["a"].new_token_ids == [9, 10] and a.num_computed_tokens == a.num_tokens - 1
    assert outs["b"].finish_reason == "length" and b.output_token_ids == [8, 11, 12]
    assert path.with_burst(path.schedule(), 1).decode_burst == 1  # one step a pass: as scheduled
    sampled = lifecycle()
    sampled.add(Request("s", [1, 2, 3], SamplingParams(max_tokens=20)))
    step(sampled, {"s": [4]})
    assert sampled.with_burst(sampled.schedule(), 4).decode_burst == 1


def test_a_burst_stops_at_the_model_length_and_a_stop_token_discards_the_rest():
    path = lifecycle(max_model_len=9)
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0, stop_token_ids=[5]))
    path.add(request)
    step(path, {"r": [4]})
    plan = path.with_burst(path.schedule(), 8)
    assert plan.decode_burst == 9 - request.num_tokens  # its length's room: 5 tokens
    outs = path.apply(plan, StepResult({"r": [6, 5, 7, 7, 7]}))
    assert outs[0].new_token_ids == [6, 5] and outs[0].finish_reason == "stop"
    assert not path.has_unfinished() and free_blocks(path) == BLOCKS - 1
