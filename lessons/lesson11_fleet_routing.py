"""Lesson 11: several replicas behind sglang-router; round_robin scatters each tenant's prefix, cache_aware
keeps it where it was computed. Measured on real replicas through the real router (``lessons/fleet.py``)."""
from __future__ import annotations

from typing import Any

from .core import Checkpoint, QuizQuestion, Text, Trace, pct
from .fleet import FleetRequest, FleetRun, FleetScenario
from .texts import DOCUMENTS, OTHER_SYSTEM, QUESTIONS, SYSTEM

NUMBER = 11
TITLE = "Many engines: route with the cache in mind"
SUMMARY = ("two replicas behind sglang-router, four tenants' system prompts: round_robin scatters them, "
           "cache_aware keeps each where its blocks are")

# Four tenants, each with its own system prompt (lengths differ, so the router's tree sizes never tie).
TENANTS = {"A": Text(SYSTEM, 192), "B": Text(OTHER_SYSTEM, 176), "C": Text(DOCUMENTS[2], 160),
           "D": Text(DOCUMENTS[4], 208)}
# Who asks when: every tenant six times, shuffled (random.Random(0)), so round_robin sends each to both replicas.
ORDER = "C A C B B B D D B A A D A D A D B D C C B A C C".split()
QUESTION_TOKENS = (24, 32, 40, 28)      # one user's question after the system prompt (varied, as users are)
MAX_TOKENS = 8

SCENARIO = FleetScenario(
    # A pool of 48 blocks holds two tenants' prefixes and four requests at work, not four tenants': the pressure
    # a real fleet is under, where each replica's memory holds only some of the prefixes it is sent.
    options=dict(block_size=16, num_blocks=48, max_model_len=512, num_threads=1),
    requests=tuple(FleetRequest(f"r{i}", tenant, TENANTS[tenant],
                                Text(QUESTIONS[i % len(QUESTIONS)], QUESTION_TOKENS[i % len(QUESTION_TOKENS)]), max_tokens=MAX_TOKENS)
                   for i, tenant in enumerate(ORDER)),
    replicas=2,
    in_flight=4,
    variants={"cache_aware": {}, "round_robin": {}},
)


def counters(run: Any) -> dict[str, float]:
    """A replica's cumulative counters after its last step (its prefix-cache hits and queries, in tokens)."""
    return run.events[-1].counters if run.events else {}


def hit_rate(runs: list[Any]) -> float:
    hits = sum(counters(r).get("prefix_cache_hits", 0.0) for r in runs)
    return pct(hits, sum(counters(r).get("prefix_cache_queries", 0.0) for r in runs))


def tenants_on(fleet: FleetRun, replica: int) -> str:
    return "".join(sorted({SCENARIO.request(rid).tenant for rid in fleet.served(replica)}))


def repeat_hits(fleet: FleetRun) -> tuple[int, int]:
    """(requests that found their whole system prompt cached, requests whose tenant had been sent before)."""
    seen, repeats, whole = set(), 0, 0
    for rid in fleet.routed:
        spec = SCENARIO.request(rid)
        if spec.tenant in seen:
            repeats += 1
            whole += cached_tokens(fleet, rid) >= TENANTS[spec.tenant].num_tokens // 16 * 16
        seen.add(spec.tenant)
    return whole, repeats


def cached_tokens(fleet: FleetRun, rid: str) -> int:
    run, sid = fleet.replicas[fleet.routed[rid]], fleet.server_ids[rid]
    return next(s.num_cached_tokens for ev in run.events for s in ev.scheduled if s.request_id == sid)


def measure(runs: dict[str, FleetRun]) -> dict[str, Any]:
    block_size = SCENARIO.options["block_size"]
    out: dict[str, Any] = {
        "num_tenants": len(TENANTS), "num_requests": len(SCENARIO.requests), "replicas": SCENARIO.replicas,
        "in_flight": SCENARIO.in_flight,
        "per_tenant": ORDER.count("A"),
        "sys_min": min(t.num_tokens for t in TENANTS.values()), "sys_max": max(t.num_tokens for t in TENANTS.values()),
        "text_tokens": sum(r.text_tokens for r in SCENARIO.requests),
        "pool_tenants": SCENARIO.options["num_blocks"] * block_size // max(t.num_tokens for t in TENANTS.values()),
    }
    for name, fleet in runs.items():
        out[f"{name}_hit_rate"] = hit_rate(fleet.replicas)
        out[f"{name}_prefill"] = sum(r.prefill_tokens for r in fleet.replicas)
        out[f"{name}_evicted"] = int(sum(counters(r).get("blocks_evicted", 0.0) for r in fleet.replicas))
        whole, repeats = repeat_hits(fleet)
        out[f"{name}_whole_hits"], out["repeats"] = whole, repeats
        for i, run in enumerate(fleet.replicas):
            out[f"{name}_r{i}_hit_rate"] = hit_rate([run])
            out[f"{name}_r{i}_requests"] = len(fleet.served(i))
            out[f"{name}_r{i}_tenants"] = tenants_on(fleet, i)
    out["prefill_saved"] = out["round_robin_prefill"] - out["cache_aware_prefill"]
    out["prefill_saved_share"] = pct(out["prefill_saved"], out["round_robin_prefill"])
    return out


# ------------------------------------------------------------------------------------ checkpoints
# Each is a predicate over one replica's stream (what ``minipaged watch --attach`` on a replica folds). No
# panel ticks them live (the fleet page has none): they are what to look for, and the headless tests feed
# every replica's events to them to check that each run shows it.

def _whole_prefix_hit(t: Trace) -> Any:
    for s in t.last.scheduled:
        if s.prefix_lookup is not None and s.num_cached_tokens >= TENANTS["C"].num_tokens:
            return f"step {t.last.step}: {s.num_cached_tokens} of the prompt's tokens were cached on this replica"
    return None


def _evicted_a_prefix(t: Trace) -> Any:
    evicted = len(t.last.kv.evicted)
    return evicted >= 8 and f"step {t.last.step}: {evicted} cached blocks evicted to make room for another tenant"


def _missed_what_it_had(t: Trace) -> Any:
    for s in t.last.scheduled:
        lookup = s.prefix_lookup
        if lookup is not None and lookup.reason == "evicted" and lookup.num_hit_blocks == 0:
            return f"step {t.last.step}: block 0 missed: evicted at step {lookup.evicted_step} for {lookup.evicted_for}"
    return None


def _all_done(t: Trace) -> Any:
    requests = list(t.view.requests.values())
    if not requests or any(r.state != "finished" for r in requests) or t.events[-1].waiting:
        return None
    return all(r.num_output_tokens == r.max_tokens for r in requests) and \
        f"{len(requests)} requests on this replica, every one got all its tokens"


CHECKPOINTS = [
    Checkpoint("a request finds its tenant's whole system prompt cached on the replica it was sent to",
               _whole_prefix_hit, "send the lesson's requests (--send) and watch a tenant's second request"),
    Checkpoint("round_robin: a replica evicts one tenant's prefix to make room for another's", _evicted_a_prefix,
               "watch the block map of one replica as the third tenant arrives there", variants=("round_robin",)),
    Checkpoint("round_robin: a tenant's prefix was cached here once, and evicted before the tenant came back",
               _missed_what_it_had, "attach the TUI to a replica and select a request that found nothing cached",
               variants=("round_robin",)),
    Checkpoint("every request finished with all its tokens", _all_done, "let the run finish"),
]

QUIZ = [
    QuizQuestion(
        "{{measured.num_tenants}} tenants, {{measured.replicas}} replicas, a pool that holds about "
        "{{measured.pool_tenants}} tenants' prefixes. Round robin sends each tenant to every replica. Why does "
        "that cost prefill?",
        ("It does not: each replica caches every prefix it sees", "Each replica must hold every tenant's prefix; "
         "its pool cannot, so it evicts prefixes it will be asked for again", "Round robin disables prefix "
         "caching on the replicas", "The router re-tokenizes the prompts"),
        1,
        "Round robin's fleet hit rate was {{measured.round_robin_hit_rate:.0%}}, cache_aware's "
        "{{measured.cache_aware_hit_rate:.0%}}: the same requests, the same replicas, {{measured.prefill_saved}} "
        "prefill tokens apart."),
    QuizQuestion(
        "How does sglang-router's cache_aware policy know what a replica has cached?",
        ("It asks each replica for its block hashes", "It reads vLLM's KV events", "It keeps, per replica, a "
         "radix tree of the text it sent there, and guesses", "It hashes the prompt to pick a replica"),
        2,
        "The router never hears from the engine's cache: its tree is what it sent, not what survived eviction. "
        "llm-d's precise scorer reads the engines' KV events instead (`minipaged serve --kv-events-config`)."),
    QuizQuestion(
        "A new tenant's first request matches no replica's tree above cache_threshold. Where does cache_aware "
        "send it?",
        ("To the replica with the smallest tree", "To replica 0", "To a random replica", "It waits until a "
         "replica has it cached"),
        0,
        "Below the threshold it picks the smallest tree, the replica with the most room by its guess; here "
        "the first replica got tenants {{measured.cache_aware_r0_tenants}} and the second tenants "
        "{{measured.cache_aware_r1_tenants}}."),
    QuizQuestion(
        "If every tenant's requests go to one replica, what can go wrong?",
        ("Nothing: hits are all that matter", "One replica can get most of the load while another idles; the "
         "router then routes by load, not by cache", "Outputs change", "The KV blocks leak"),
        1,
        "cache_aware switches to the shortest queue when the loads differ by more than balance_abs_threshold "
        "and balance_rel_threshold. In this run {{measured.in_flight}} requests were in flight at a time and "
        "the replicas served {{measured.cache_aware_r0_requests}} and {{measured.cache_aware_r1_requests}}: "
        "the loads never differed enough, and every request was routed by its text."),
]
