"""Prometheus metrics folded from StepEvents agree with the engine's own counters."""
from __future__ import annotations

import random

from prometheus_client.parser import text_string_to_metric_families

from minipaged import SamplingParams
from minipaged.metrics import EngineMetrics
from tests.conftest import random_prompts


def test_metrics_match_the_engine_after_a_preempting_shared_prefix_run(tiny_engine_factory):
    engine = tiny_engine_factory(num_blocks=24, preemption_mode="swap", num_cpu_blocks=12)
    metrics = EngineMetrics(engine)
    system = list(range(40, 64))
    prompts = [system + p for p in random_prompts(random.Random(2), 8, 4, 20)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.generate(prompts, params)
    engine.add_request([1, 2, 3], params, request_id="gone")
    engine.step()
    engine.abort("gone")
    engine.step()
    stats = engine.stats()

    assert metrics.value("generation_tokens_total") == stats["generation_tokens"] == 8 * 12 + 1
    assert metrics.value("prompt_tokens_total") == stats["prompt_tokens_computed"]
    assert metrics.value("prefix_cache_hits_total") == stats["prefix_cache_hits"] > 0
    assert metrics.value("prefix_cache_queries_total") == stats["prefix_cache_queries"]
    for mode in ("swap", "recompute"):                # a small CPU pool: swaps, and one falls back to recompute
        assert metrics.value("num_preemptions_total", mode=mode) == stats[f"preemptions_{mode}"] > 0
    assert metrics.value("request_success_total", finished_reason="length") == 8
    assert metrics.value("request_success_total", finished_reason="abort") == 1
    assert metrics.value("time_to_first_token_seconds_count") == 9
    assert metrics.value("inter_token_latency_seconds_count") == 8 * 11
    assert metrics.value("step_duration_seconds_count") == stats["steps"]
    assert metrics.value("num_requests_running") == 0 and metrics.value("kv_cache_usage_perc") == 0.0

    # The exposition is valid Prometheus text with vLLM's names under our prefix.
    families = {f.name for f in text_string_to_metric_families(metrics.exposition())}
    assert {"minipaged:num_requests_running", "minipaged:kv_cache_usage_perc", "minipaged:num_preemptions",
            "minipaged:time_to_first_token_seconds"} <= families


def test_ttft_is_observed_at_the_first_token_and_late_attachment_counts_from_then(tiny_engine_factory):
    engine = tiny_engine_factory()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.generate([list(range(10, 40))], params)            # history from before the metrics existed
    metrics = EngineMetrics(engine)
    engine.add_request(list(range(10, 40)), params, request_id="r")
    event = engine.step().event
    assert event.new_token_ids and not event.finished
    assert metrics.value("time_to_first_token_seconds_count") == 1
    assert metrics.value("request_success_total", finished_reason="length") is None
    arrival = event.arrivals[0].arrival_s
    assert arrival is not None and 0 < event.time_s - arrival == metrics.value("time_to_first_token_seconds_sum")
    stats = engine.stats()
    assert metrics.value("prefix_cache_queries_total") == 30 < stats["prefix_cache_queries"]   # this request only
    assert metrics.value("prefix_cache_hits_total") == 28                            # its 7 cached blocks


def test_two_engines_keep_their_own_numbers(tiny_engine_factory):
    first, second = tiny_engine_factory(), tiny_engine_factory()
    a, b = EngineMetrics(first), EngineMetrics(second)
    first.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert a.value("generation_tokens_total") == 5 and b.value("generation_tokens_total") == 0
