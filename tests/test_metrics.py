"""Prometheus metrics folded from StepEvents agree with the engine's own counters."""
from __future__ import annotations

import random

import pytest
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

    # ... and again under vLLM's own names, labelled with the model as vLLM labels them: the same numbers.
    vllm = {"model_name": engine.info.model}
    sample = metrics.registry.get_sample_value
    for name in ("generation_tokens_total", "prefix_cache_hits_total", "time_to_first_token_seconds_count",
                 "request_prompt_tokens_sum", "num_requests_running"):
        assert sample("vllm:" + name, vllm) == metrics.value(name) is not None, name
    assert sample("vllm:num_preemptions_total", {**vllm, "mode": "swap"}) == stats["preemptions_swap"]
    assert sample("vllm:gpu_cache_usage_perc", vllm) == sample("vllm:kv_cache_usage_perc", vllm) == 0.0
    assert sample("vllm:time_per_output_token_seconds_count", vllm) == 8 * 11      # vLLM's older name of the ITL
    assert sample("vllm:request_max_num_generation_tokens_sum", vllm) == 9 * 12
    assert "vllm:step_duration_seconds" not in families | {f.name for f in text_string_to_metric_families(
        metrics.exposition())}                                                     # minipaged's own, no vLLM twin


def test_a_requests_phases_queue_prefill_decode(tiny_engine_factory):
    """vLLM's per-request phases: a request that waits for the only seat queues for about the other's whole run."""
    engine = tiny_engine_factory(max_num_seqs=1)
    metrics = EngineMetrics(engine)
    events = []
    engine.subscribe(events.append)
    engine.generate([[5, 6, 7, 8, 9], [9, 8, 7, 6, 5]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    second_arrived = events[0].arrivals[1].arrival_s
    first_done = next(e.time_s for e in events if e.finished)
    counts = {name: metrics.value(f"request_{name}_time_seconds_count") for name in ("queue", "prefill", "decode",
                                                                                     "inference")}
    assert counts == {"queue": 2, "prefill": 2, "decode": 2, "inference": 2}
    # each phase as vLLM defines it, read off the events: queued until a step first schedules the request,
    # prefill until its first token, decode until its last
    arrival = {a.request_id: a.arrival_s for a in events[0].arrivals}
    start = {rid: next(e.time_s - e.duration_s for e in events if rid in {s.request_id for s in e.scheduled})
             for rid in arrival}
    first = {rid: next(e.time_s for e in events if rid in e.new_token_ids) for rid in arrival}
    end = {rid: next(e.time_s for e in events if rid in {f.request_id for f in e.finished}) for rid in arrival}
    for phase, (a, b) in {"queue": (arrival, start), "prefill": (start, first), "decode": (first, end),
                          "inference": (start, end)}.items():
        assert metrics.value(f"request_{phase}_time_seconds_sum") == pytest.approx(sum(b[r] - a[r] for r in arrival))
    assert metrics.value("request_queue_time_seconds_sum") >= first_done - second_arrived > 0   # waited for the first
    assert metrics.value("cpu_cache_usage_perc") == 0.0


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
