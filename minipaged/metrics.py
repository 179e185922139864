"""Prometheus metrics, folded from StepEvents, under vLLM's metric names: twice, as ``minipaged:...`` and as
``vllm:...`` with vLLM's ``model_name`` label, so a dashboard, autoscaler or router built for vLLM's
``/metrics`` works unchanged (tests/data/vllm_grafana_metrics.txt lists what vLLM's own Grafana dashboard
queries; docs/serving.md says which vLLM metrics minipaged cannot have).

Like the TUI and the traces, metrics read events and nothing else:

    from minipaged import Engine
    from minipaged.metrics import EngineMetrics

    engine = Engine("smollm2")
    metrics = EngineMetrics(engine)          # subscribes to the engine's StepEvents
    engine.generate(["Hello"])
    print(metrics.exposition())              # what a Prometheus server would scrape

Each ``EngineMetrics`` has its own registry, so two engines in one process do not mix their numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.metrics import MetricWrapperBase

from .event_view import LatencyFold
from .events import StepEvent

PREFIX = "minipaged:"
VLLM_PREFIX = "vllm:"
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)


class EngineMetrics:
    """Gauges of the engine's state after each step, counters of what it did, histograms of latencies."""

    def __init__(self, engine: Any = None, registry: Optional[CollectorRegistry] = None,
                 subscribe: Optional[Callable[[Callable[[StepEvent], None]], Any]] = None,
                 model_name: Optional[str] = None, since: Optional[dict[str, float]] = None) -> None:
        """``subscribe``: how ``observe`` is to get the engine's StepEvents (by default ``engine.subscribe``: in
        the engine's thread; a server passes ``AsyncEngine.subscribe_in_loop``, to fold them on its event loop).
        ``model_name``: the ``model_name`` label of the ``vllm:`` copies (a server's served model name; by
        default the engine's model). ``since``: without ``engine``, the engine's stats when counting starts."""
        self.registry = registry or CollectorRegistry()
        if model_name is None:
            model_name = engine.info.model if engine is not None else "minipaged"
        r, p = self.registry, PREFIX
        self.running = Gauge(p + "num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting to be admitted", registry=r)
        self.swapped = Gauge(p + "num_requests_swapped", "Requests whose KV is swapped out to CPU", registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_perc", "Share of KV blocks in use (1 = full)", registry=r)
        self.cpu_usage = Gauge(p + "cpu_cache_usage_perc", "Share of the CPU swap pool's blocks in use (0 with no "
                               "swap pool)", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prefill tokens computed (chunks and recomputes "
                                     "included, cache hits excluded)", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.preemptions = Counter(p + "num_preemptions", "Preemptions", ["mode"], registry=r)
        self.prefix_queries = Counter(p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r)
        self.finished = Counter(p + "request_success", "Finished requests", ["finished_reason"], registry=r)
        # Per finished request, as vLLM's request_prompt_tokens / request_generation_tokens: their _sum and
        # _count are exact totals of what clients asked for and got (prompt_tokens above counts computation).
        self.request_prompt_tokens = Histogram(p + "request_prompt_tokens", "Prompt length of finished requests",
                                               registry=r, buckets=TOKEN_BUCKETS)
        self.request_generation_tokens = Histogram(p + "request_generation_tokens", "Tokens generated per finished "
                                                   "request", registry=r, buckets=TOKEN_BUCKETS)
        self.max_tokens = Histogram(p + "request_max_num_generation_tokens", "max_tokens of finished requests",
                                    registry=r, buckets=TOKEN_BUCKETS)
        # A finished request's life in phases, vLLM's: waiting, first scheduled -> first token -> last token.
        self.queue_time = Histogram(p + "request_queue_time_seconds", "Arrival to first scheduled", registry=r,
                                    buckets=LATENCY_BUCKETS)
        self.prefill_time = Histogram(p + "request_prefill_time_seconds", "First scheduled to first token",
                                      registry=r, buckets=LATENCY_BUCKETS)
        self.decode_time = Histogram(p + "request_decode_time_seconds", "First token to finish", registry=r,
                                     buckets=LATENCY_BUCKETS)
        self.inference_time = Histogram(p + "request_inference_time_seconds", "First scheduled to finish",
                                        registry=r, buckets=LATENCY_BUCKETS)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to finish", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Gap between two tokens of a request", registry=r,
                             buckets=LATENCY_BUCKETS)
        # speculative decoding, vLLM's names: acceptance rate = accepted / draft tokens
        self.spec_drafts = Counter(p + "spec_decode_num_drafts", "Verifications of a request's drafts", registry=r)
        self.spec_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.spec_accepted = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.spec_accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by position in the draft", ["position"],
                                             registry=r)
        self.communication = Counter(p + "communication_seconds", "Seconds rank 0 spent sending to, receiving "
                                     "from and waiting for other ranks (tensor/pipeline parallelism)", registry=r)
        self.step_time = Histogram(p + "step_duration_seconds", "One engine step", registry=r,
                                   buckets=LATENCY_BUCKETS)
        self._latency = LatencyFold()
        self._phases: dict[str, _Phases] = {}
        # minipaged's own metrics again under vLLM's names (read when scraped: nothing is counted twice)
        self.registry.register(VllmNames([m for m in vars(self).values() if isinstance(m, MetricWrapperBase)],
                                         model_name))
        # Count from now on, like every other metric here, even if the engine has run before.
        stats = engine.stats() if engine is not None else (since or {})
        self._counters_seen: dict[str, float] = {
            name: float(stats[name]) for name in ("prefix_cache_queries", "prefix_cache_hits", "communication_seconds")
            if name in stats}
        if engine is not None or subscribe is not None:
            (subscribe or engine.subscribe)(self.observe)

    def observe(self, event: StepEvent) -> None:
        """Fold one StepEvent in (the engine calls this after every step once subscribed)."""
        self.running.set(len(event.running))
        self.waiting.set(len(event.waiting))
        self.swapped.set(len(event.swapped))
        if event.num_total_blocks:
            self.kv_usage.set((event.num_total_blocks - event.num_free_blocks) / event.num_total_blocks)
        if event.num_total_cpu_blocks:
            self.cpu_usage.set((event.num_total_cpu_blocks - event.num_free_cpu_blocks) / event.num_total_cpu_blocks)
        self.prompt_tokens.inc(event.num_prefill_tokens)
        self.generation_tokens.inc(sum(len(t) for t in event.new_token_ids.values()))
        for p in event.preempted:
            self.preemptions.labels(mode=p.mode).inc()
        self.prefix_queries.inc(self._delta(event, "prefix_cache_queries"))
        self.prefix_hits.inc(self._delta(event, "prefix_cache_hits"))
        for s in event.scheduled:
            if s.draft_token_ids:
                self.spec_drafts.inc()
                self.spec_draft_tokens.inc(len(s.draft_token_ids))
                self.spec_accepted.inc(s.num_accepted)
                for position in range(s.num_accepted):
                    self.spec_accepted_per_pos.labels(position=str(position)).inc()
        self.communication.inc(self._delta(event, "communication_seconds"))
        self.step_time.observe(event.duration_s)
        step_start = event.time_s - event.duration_s     # for old traces, whose arrivals carry no time
        ttfts, gaps = self._latency.apply(
            event, event.time_s, lambda a: a.arrival_s if a.arrival_s is not None else step_start)
        for ttft in ttfts:                               # observed at the first token, as vLLM does
            self.ttft.observe(ttft)
        for gap in gaps:
            self.itl.observe(gap)
        self._fold_phases(event, step_start)
        for f in event.finished:
            self.finished.labels(finished_reason=f.finish_reason).inc()
            self.e2e.observe(f.e2e_s)
            self.request_prompt_tokens.observe(f.num_prompt_tokens)
            self.request_generation_tokens.observe(f.num_output_tokens)

    def _fold_phases(self, event: StepEvent, step_start: float) -> None:
        """Note when each request arrived, was first scheduled and got its first token; observe the phases of
        those that finish (a request that arrived before the metrics did is left out, as with TTFT)."""
        for a in event.arrivals:
            self._phases[a.request_id] = _Phases(a.arrival_s if a.arrival_s is not None else step_start,
                                                 a.max_tokens)
        for s in event.scheduled:
            phases = self._phases.get(s.request_id)
            if phases is not None and phases.scheduled_s is None:
                phases.scheduled_s = step_start
        for rid in event.new_token_ids:
            phases = self._phases.get(rid)
            if phases is not None and phases.first_token_s is None:
                phases.first_token_s = event.time_s
        for f in event.finished:
            phases = self._phases.pop(f.request_id, None)
            if phases is None:
                continue
            self.max_tokens.observe(phases.max_tokens)
            if phases.scheduled_s is None:           # aborted while waiting: it only queued
                self.queue_time.observe(event.time_s - phases.arrival_s)
                continue
            self.queue_time.observe(phases.scheduled_s - phases.arrival_s)
            self.inference_time.observe(event.time_s - phases.scheduled_s)
            if phases.first_token_s is not None:
                self.prefill_time.observe(phases.first_token_s - phases.scheduled_s)
                self.decode_time.observe(event.time_s - phases.first_token_s)

    def _delta(self, event: StepEvent, name: str) -> float:
        """Events carry cumulative engine counters; a Prometheus counter wants the increase."""
        now = float(event.counters.get(name, 0.0))
        delta = now - self._counters_seen.get(name, 0.0)
        self._counters_seen[name] = now
        return max(delta, 0.0)

    def exposition(self) -> str:
        """The metrics in Prometheus' text format (what a ``/metrics`` endpoint serves)."""
        return generate_latest(self.registry).decode("utf-8")

    def value(self, name: str, **labels: str) -> Optional[float]:
        """One sample's current value, e.g. ``value("num_preemptions_total", mode="swap")``."""
        return self.registry.get_sample_value(PREFIX + name, labels or None)


@dataclass
class _Phases:
    """One request's timestamps on the engine's clock, until it finishes."""
    arrival_s: float
    max_tokens: int
    scheduled_s: Optional[float] = None
    first_token_s: Optional[float] = None


# minipaged's metric (without the prefix) -> its vLLM names. vLLM renamed two in v1 and kept the old names for a
# while; both are served, so dashboards of either generation work. minipaged's own step_duration_seconds and
# communication_seconds have no vLLM counterpart and stay minipaged-only.
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
    "num_requests_swapped": ("num_requests_swapped",),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "cpu_cache_usage_perc": ("cpu_cache_usage_perc",),
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "num_preemptions": ("num_preemptions",),
    "prefix_cache_queries": ("prefix_cache_queries",),
    "prefix_cache_hits": ("prefix_cache_hits",),
    "request_success": ("request_success",),
    "request_prompt_tokens": ("request_prompt_tokens",),
    "request_generation_tokens": ("request_generation_tokens",),
    "request_max_num_generation_tokens": ("request_max_num_generation_tokens",),
    "request_queue_time_seconds": ("request_queue_time_seconds",),
    "request_prefill_time_seconds": ("request_prefill_time_seconds",),
    "request_decode_time_seconds": ("request_decode_time_seconds",),
    "request_inference_time_seconds": ("request_inference_time_seconds",),
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "inter_token_latency_seconds": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
    "spec_decode_num_drafts": ("spec_decode_num_drafts",),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens",),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens",),
    "spec_decode_num_accepted_tokens_per_pos": ("spec_decode_num_accepted_tokens_per_pos",),
}


class VllmNames:
    """A Prometheus collector: the samples of minipaged's metrics, renamed to ``vllm:`` and labelled with
    ``model_name`` as vLLM labels its own, read when scraped (one fold, two sets of names)."""

    def __init__(self, metrics: list[MetricWrapperBase], model_name: str) -> None:
        self.metrics = metrics
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for metric in self.metrics:
            for family in metric.collect():
                for name in VLLM_NAMES.get(family.name[len(PREFIX):], ()):
                    renamed = Metric(VLLM_PREFIX + name, family.documentation, family.type)
                    for s in family.samples:
                        if s.name.endswith("_created"):
                            continue
                        renamed.add_sample(VLLM_PREFIX + name + s.name[len(family.name):],
                                           {"model_name": self.model_name, **s.labels}, s.value)
                    yield renamed
