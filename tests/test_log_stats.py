"""``--log-stats`` (``log_stats=True``): a line of engine statistics every interval while the
engine steps, with vLLM's figures; the token counts behind it are the engine's own."""

from __future__ import annotations

import logging

from engine import LLM, SamplingParams
from engine.client import stats_logger
from engine.client.stats_logger import StatsLogger, stats_line
from engine.messages.stats import EngineStats

LOGGER = stats_logger.__name__


def test_a_line_per_interval_with_rates_over_the_interval(caplog):
    clock = [0.0]
    logger = StatsLogger("engine 1", interval=10.0, clock=lambda: clock[0])
    busy = EngineStats(
        running=2,
        waiting=1,
        kv_cache_usage=0.25,
        prompt_tokens=300,
        generation_tokens=50,
        prefix_queries=40,
        prefix_hits=10,
    )
    clock[0] = 9.0
    logger.tick(lambda: busy)
    assert not caplog.records  # not yet due: the stats are not even built
    clock[0] = 10.0
    logger.tick(lambda: busy)
    later = EngineStats(prompt_tokens=300, generation_tokens=250, prefix_queries=50, prefix_hits=19)
    clock[0] = 30.0
    logger.tick(lambda: later)
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        (
            "engine 1: prompt throughput 30.0 tokens/s, generation throughput 5.0 tokens/s, running 2 reqs, "
            "waiting 1 reqs, KV cache usage 25.0%, prefix cache hit rate 25.0%"
        ),
        (
            "engine 1: prompt throughput 0.0 tokens/s, generation throughput 10.0 tokens/s, running 0 reqs, "
            "waiting 0 reqs, KV cache usage 0.0%, prefix cache hit rate 90.0%"
        ),
    ]
    assert "prefix cache hit rate 0.0%" in stats_line("e", EngineStats(), EngineStats(), 1.0)


def test_llm_logs_its_stats_and_counts_every_token(tiny_llama, caplog, monkeypatch):
    monkeypatch.setattr(stats_logger, "LOG_INTERVAL_S", 0.0)  # a line every step
    llm = LLM(tiny_llama[0], dtype="float32", num_blocks=64, block_size=16, log_stats=True)
    prompts = ["Once upon a time", "The weather today is"]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO]
    assert lines and all(line.startswith("engine: prompt throughput ") for line in lines)
    assert "generation throughput" in lines[-1] and "KV cache usage" in lines[-1]
    stats = llm.client.stats()
    assert stats.generation_tokens == sum(len(o.outputs[0].token_ids) for o in outputs) == 10
    assert stats.prompt_tokens == sum(len(o.prompt_token_ids) for o in outputs)
    assert stats.running == stats.waiting == 0 and stats.tokens_per_step.buckets[-1][0] == "+Inf"


def test_without_log_stats_nothing_is_logged(tiny_llm, caplog):
    tiny_llm.generate("Hello", SamplingParams(max_tokens=2))
    assert not [r for r in caplog.records if r.name == LOGGER]
