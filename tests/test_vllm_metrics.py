"""/metrics under vLLM's names: a real `engine serve` on the tiny model under a few concurrent
requests answers every series vLLM's example Grafana dashboard queries, with sensible values,
and the rest of vLLM's request and engine metrics."""

from __future__ import annotations

import asyncio

import attrs
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.messages.stats import EngineStats, TokensPerStep
from engine_server.metrics import Metrics
from tests.serving import serve

# Every series the PromQL of vLLM's example dashboard
# (examples/online_serving/prometheus_grafana/grafana.json) reads.
DASHBOARD_SERIES = (
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)
HISTOGRAMS = (
    "time_to_first_token_seconds",
    "time_per_output_token_seconds",
    "inter_token_latency_seconds",
    "request_time_per_output_token_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_inference_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_max_num_generation_tokens",
    "request_params_max_tokens",
    "request_params_n",
    "iteration_tokens_total",
)
SCALARS = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "gpu_cache_usage_perc",
    "num_preemptions_total",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total",
)
SERVE_ARGS = (
    "--served-model-name",
    "tiny-llama",
    "--dtype",
    "float32",
    "--num-blocks",
    "256",
    "--block-size",
    "16",
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "2",
)
NUM_REQUESTS, MAX_TOKENS = 6, 8


def samples(text: str) -> dict[str, list]:
    """Series name -> its samples, from the Prometheus text format."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def value(series: dict[str, list], name: str, **labels) -> float:
    return sum(s.value for s in series[name] if all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="module")
def loaded(tiny_llama):
    """The server's /metrics after NUM_REQUESTS concurrent streams, two at a time running
    (``--max-num-seqs 2``), so some of them queue."""
    with serve(tiny_llama[0], *SERVE_ARGS, api_key=None) as server:
        client = server.openai(openai.AsyncOpenAI)

        async def one(i: int):
            stream = await client.completions.create(
                model="tiny-llama",
                prompt=f"Robot number {i} said",
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            return [chunk async for chunk in stream]

        async def main():
            return await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))

        asyncio.run(main())
        yield samples(httpx.get(f"{server.url}/metrics").text)


def test_every_series_of_vllms_dashboard_resolves(loaded):
    missing = [name for name in DASHBOARD_SERIES if name not in loaded]
    assert not missing
    for name in DASHBOARD_SERIES:
        assert all(s.labels.get("model_name") == "tiny-llama" for s in loaded[name]), name


def test_vllms_request_and_engine_metrics_resolve(loaded):
    for name in HISTOGRAMS:
        for suffix in ("_bucket", "_sum", "_count"):
            assert f"vllm:{name}{suffix}" in loaded, name + suffix
    for name in SCALARS:
        assert f"vllm:{name}" in loaded, name
    info = loaded["vllm:cache_config_info"][0]
    assert info.value == 1 and info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == "256"
    assert "reason" in loaded["vllm:num_requests_rejected_total"][0].labels
    assert not [name for name in loaded if name.startswith("engine:")]


def test_values_under_load_are_sensible(loaded):
    finished = value(loaded, "vllm:request_success_total", finished_reason="length")
    assert finished == NUM_REQUESTS
    for name in (
        "request_prompt_tokens",
        "request_generation_tokens",
        "e2e_request_latency_seconds",
        "time_to_first_token_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_params_n",
        "request_params_max_tokens",
        "request_max_num_generation_tokens",
    ):
        assert value(loaded, f"vllm:{name}_count") == NUM_REQUESTS, name
    assert value(loaded, "vllm:request_generation_tokens_sum") == NUM_REQUESTS * MAX_TOKENS
    assert value(loaded, "vllm:generation_tokens_total") == NUM_REQUESTS * MAX_TOKENS
    assert value(loaded, "vllm:request_params_max_tokens_sum") == NUM_REQUESTS * MAX_TOKENS
    prompt_tokens = value(loaded, "vllm:request_prompt_tokens_sum")
    assert prompt_tokens == value(loaded, "vllm:prompt_tokens_total") > NUM_REQUESTS
    # every token after a request's first is one per-token interval
    intervals = NUM_REQUESTS * (MAX_TOKENS - 1)
    assert value(loaded, "vllm:time_per_output_token_seconds_count") == intervals
    assert value(loaded, "vllm:inter_token_latency_seconds_count") == intervals
    assert value(loaded, "vllm:time_per_output_token_seconds_sum") > 0
    assert value(loaded, "vllm:request_time_per_output_token_seconds_sum") > 0
    assert value(loaded, "vllm:request_queue_time_seconds_sum") >= 0
    # two run at a time: the other four waited in the queue for a running pair to finish
    assert value(loaded, "vllm:request_queue_time_seconds_sum") > 0
    assert value(loaded, "vllm:request_prefill_time_seconds_sum") > 0
    assert value(loaded, "vllm:request_decode_time_seconds_sum") > 0
    inference = value(loaded, "vllm:request_inference_time_seconds_sum")
    e2e = value(loaded, "vllm:e2e_request_latency_seconds_sum")
    assert value(loaded, "vllm:request_decode_time_seconds_sum") < inference < e2e


def test_tokens_per_step_histogram_counts_every_computed_token(loaded):
    steps = value(loaded, "vllm:iteration_tokens_total_count")
    tokens = value(loaded, "vllm:iteration_tokens_total_sum")
    # each step computes the new prompt tokens and one token per decoding request; the
    # last sampled token of each request is never fed back
    assert tokens == value(loaded, "vllm:prompt_tokens_total") + NUM_REQUESTS * (MAX_TOKENS - 1)
    assert steps >= MAX_TOKENS * NUM_REQUESTS / 2
    buckets = [s for s in loaded["vllm:iteration_tokens_total_bucket"]]
    assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == steps
    assert [s.value for s in buckets] == sorted(s.value for s in buckets)


def test_metrics_prefix_engine_keeps_the_old_names():
    metrics = Metrics("m", "engine")
    (timer,) = metrics.start_request(3, 2, 1)
    timer.tokens(1, (0.01, 0.02))
    timer.tokens(1)
    timer.finished("length")
    series = samples(metrics.render().decode())
    assert value(series, "engine:request_success_total", finished_reason="length") == 1
    assert value(series, "engine:request_queue_time_seconds_sum") == 0.01
    assert value(series, "engine:time_per_output_token_seconds_count") == 1
    assert not [name for name in series if name.startswith("vllm:")]
    with pytest.raises(ValueError, match="metrics prefix"):
        Metrics("m", "tgi")


def test_each_engine_stat_becomes_its_series():
    metrics = Metrics("m")
    metrics.engine_ready({"block_size": "16"}, engines=2)
    stats = EngineStats(
        running=3,
        waiting=1,
        kv_cache_usage=0.5,
        preemptions=2,
        prefix_queries=10,
        prefix_hits=4,
        rejected_queue_wait=1,
        spec_drafts=2,
        spec_accepted_per_pos=(3, 1),
        kv_load_bytes=64,
        mm_encoder_runs=2,
        tokens_per_step=TokensPerStep((("1", 2), ("8", 5), ("+Inf", 6)), 30),
    )
    metrics.update_engine(stats, engine=1)
    metrics.update_engine(attrs.evolve(stats, preemptions=5), engine=1)
    series, one = samples(metrics.render().decode()), {"engine": "1"}
    assert value(series, "vllm:num_requests_running", **one) == 3
    assert (
        value(series, "vllm:gpu_cache_usage_perc", **one)
        == value(series, "vllm:kv_cache_usage_perc", **one)
        == 0.5
    )
    assert value(series, "vllm:prefix_cache_hit_rate", **one) == 0.4
    assert value(series, "vllm:num_preemptions_total", **one) == 5  # running totals, counted once
    assert value(series, "vllm:num_requests_rejected_total", reason="queue_wait", **one) == 1
    assert value(series, "vllm:num_requests_rejected_total", reason="queue_full", engine="0") == 0
    assert value(series, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="1", **one) == 1
    assert value(series, "vllm:kv_connector_load_bytes_total", **one) == 64
    assert value(series, "vllm:mm_encoder_runs_total", **one) == 2
    assert value(series, "vllm:iteration_tokens_total_count", **one) == 6
    assert value(series, "vllm:iteration_tokens_total_sum", **one) == 30


def test_generation_config_and_metrics_prefix_flags():
    from engine.entrypoints.cli_args import ArgumentParser, engine_options
    from engine_server.serve import ServeCommand

    parser = ArgumentParser(prog="engine serve")
    ServeCommand().add_arguments(parser)
    args = parser.parse_args(["--generation-config", "vllm", "--metrics-prefix", "engine"])
    assert engine_options(args) == {"generation_config": "vllm"} and args.metrics_prefix == "engine"
