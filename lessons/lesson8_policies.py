"""Lesson 8: who waits, who is evicted: request order, preemption victim and prefix eviction as policies."""
from __future__ import annotations

from typing import Any

from .core import Checkpoint, QuizQuestion, Run, Scenario, Text, Trace, every_request_finished, pct, request
from .texts import DOCUMENTS, OTHER_SYSTEM, QUESTIONS, SYSTEM

NUMBER = 8
TITLE = "Who waits, who is evicted"
SUMMARY = "policies: FCFS vs priority, the preemption victim, LRU vs MRU eviction, fair share by client"

SYS_A, SYS_B = Text(SYSTEM, 128), Text(OTHER_SYSTEM, 128)     # two system prompts of 8 blocks each
NUM_ALTERNATING = 8
GREEDY, LONE = "A", "B"      # part one's clients: A sends four requests at once, B one (r4)

SCENARIO = Scenario(
    options=dict(block_size=16, num_blocks=14, max_model_len=1024, max_num_seqs=3, max_num_batched_tokens=256),
    requests=(
        # Part one: more requests than seats, and a pool too small for all of them to grow. Client A sends four
        # at once, client B one (the client matters only under --fair-share).
        request("r0", 1, Text(DOCUMENTS[0], 40), max_tokens=40, priority=5, client=GREEDY),      # low priority
        request("r1", 1, Text(DOCUMENTS[1], 56), max_tokens=32, client=GREEDY),
        request("r2", 1, Text(DOCUMENTS[2], 36), max_tokens=44, client=GREEDY),
        request("r3", 1, Text(DOCUMENTS[3], 48), max_tokens=36, client=GREEDY),
        request("r4", 6, Text(DOCUMENTS[4], 30), max_tokens=20, priority=-1, client=LONE),   # late and urgent
        # Part two, after part one has finished: one request at a time, alternating two system prompts.
        *(request(f"s{i}", 300 + 100 * i, SYS_A if i % 2 == 0 else SYS_B, Text(QUESTIONS[i], 16), max_tokens=8)
          for i in range(NUM_ALTERNATING)),
    ),
    variants={"fcfs": {}, "priority": {"scheduling_policy": "priority", "preemption_victim": "lowest-priority"},
              "most-blocks": {"preemption_victim": "most-blocks"}, "mru": {"eviction_policy": "mru"},
              "fair-share": {"fair_share": True}},
)
PART_ONE = ("r0", "r1", "r2", "r3", "r4")
PART_TWO = tuple(f"s{i}" for i in range(NUM_ALTERNATING))
GREEDY_REQUESTS = tuple(r.request_id for r in SCENARIO.requests if r.client == GREEDY)


def admission_order(run: Run) -> list[str]:
    return sorted(PART_ONE, key=run.first_scheduled_step)


def waited(run: Run, rid: str) -> int:
    """Steps from arrival to first being scheduled."""
    return run.first_scheduled_step(rid) - run.arrival_step(rid)


def recomputed_tokens(run: Run) -> int:
    """Tokens computed again because their request had been preempted (prefill after a preemption)."""
    preempted: set[str] = set()
    total = 0
    for ev in run.events:
        total += sum(s.end - s.start for s in ev.scheduled if s.kind == "prefill" and s.request_id in preempted)
        preempted |= {p.request_id for p in ev.preempted}
    return total


def cached_at_admission(run: Run, rid: str) -> int:
    ev = run.event(run.first_scheduled_step(rid))
    return next(s.num_cached_tokens for s in ev.scheduled if s.request_id == rid)


def first_token_after(run: Run, rid: str) -> int:
    """Steps from arrival to the request's first generated token (time to first token, in steps)."""
    return run.token_steps(rid)[0] - run.arrival_step(rid)


def preemptions_of(run: Run, rids: tuple[str, ...]) -> int:
    return sum(1 for ev in run.events for p in ev.preempted if p.request_id in rids)


def part_two_schedule(run: Run) -> list[tuple]:
    """What each step of part two scheduled (ids, kinds, spans, cache hits): equal lists mean equal runs."""
    start = run.arrival_step(PART_TWO[0])
    return [tuple((s.request_id, s.kind, s.start, s.end, s.num_cached_tokens) for s in ev.scheduled)
            for ev in run.events[start - 1:]]


def measure(runs: dict[str, Run]) -> dict[str, Any]:
    fcfs, prio, most, mru = runs["fcfs"], runs["priority"], runs["most-blocks"], runs["mru"]
    fair = runs["fair-share"]
    out: dict[str, Any] = {}
    for name, run in runs.items():
        key = name.replace("-", "_")
        first = next(ev for ev in run.events if ev.preempted).preempted[0]
        out[f"{key}_steps"] = run.num_steps
        out[f"{key}_order"] = " ".join(admission_order(run))
        out[f"{key}_victim"] = first.request_id
        out[f"{key}_victim_blocks"] = first.num_blocks
        out[f"{key}_preemptions"] = run.num_preemptions
        out[f"{key}_recomputed"] = recomputed_tokens(run)
        repeats = PART_TWO[2:]                          # the first of each system prompt cannot hit
        out[f"{key}_repeat_hit_tokens"] = sum(cached_at_admission(run, rid) for rid in repeats)
        out[f"{key}_repeat_hit_rate"] = pct(out[f"{key}_repeat_hit_tokens"], len(repeats) * SYS_A.num_tokens)
        out[f"{key}_same_outputs"] = run.outputs == fcfs.outputs
    out.update(
        seats=fcfs.info.max_num_seqs, num_part_one=len(PART_ONE), sys_tokens=SYS_A.num_tokens,
        sys_blocks=SYS_A.num_tokens // fcfs.info.block_size, num_alternating=NUM_ALTERNATING,
        r0_priority=SCENARIO.request("r0").priority, r4_priority=SCENARIO.request("r4").priority,
        r4_wait_fcfs=waited(fcfs, "r4"), r4_wait_priority=waited(prio, "r4"),
        r0_wait_fcfs=waited(fcfs, "r0"), r0_wait_priority=waited(prio, "r0"),
        lru_hit_per_repeat=cached_at_admission(fcfs, PART_TWO[2]), mru_hit_per_repeat=cached_at_admission(mru, PART_TWO[2]),
        lru_evictions=int(fcfs.events[-1].counters["blocks_evicted"]),
        mru_evictions=int(mru.events[-1].counters["blocks_evicted"]),
        # Fair share by client: part one's r0-r3 are client A's, r4 client B's; part two names no client.
        num_greedy=len(GREEDY_REQUESTS), r4_wait_fair_share=waited(fair, "r4"),
        r3_wait_fcfs=waited(fcfs, "r3"), r3_wait_fair_share=waited(fair, "r3"),
        r4_first_token_fcfs=first_token_after(fcfs, "r4"), r4_first_token_fair_share=first_token_after(fair, "r4"),
        r4_preempted_fcfs=preemptions_of(fcfs, ("r4",)), r4_preempted_fair_share=preemptions_of(fair, ("r4",)),
        fair_share_victim_client=SCENARIO.request(out["fair_share_victim"]).client,
        fair_share_part_two_same=part_two_schedule(fair) == part_two_schedule(fcfs),
    )
    return out


# ------------------------------------------------------------------------------------ checkpoints

def _queue(t: Trace) -> Any:
    if len(t.last.running) >= t.info.max_num_seqs and t.last.waiting:
        return f"step {t.last.step}: {', '.join(t.last.running)} hold every seat; {', '.join(t.last.waiting)} wait"
    return None


def _overtakes(t: Trace) -> Any:
    if "r4" in t.admitted() and "r0" in t.last.waiting:
        return (f"step {t.last.step}: r4 (priority {SCENARIO.request('r4').priority}) is admitted while r0 "
                f"(priority {SCENARIO.request('r0').priority}), here since the start, waits")
    return None


def _takes_turns(t: Trace) -> Any:
    waiting = [rid for rid in t.last.waiting if rid in GREEDY_REQUESTS]
    if "r4" in t.admitted() and waiting:
        return (f"step {t.last.step}: r4, client {LONE}'s only request, is admitted while client {GREEDY}'s "
                f"{', '.join(waiting)} still wait{'s' if len(waiting) == 1 else ''}")
    return None


def _preempted(t: Trace) -> Any:
    p = t.last.preempted
    if not p:
        return None
    return (f"step {t.last.step}: {p[0].request_id} gives up {p[0].num_blocks} blocks "
            f"(victim policy: {t.info.preemption_victim})")


def _hit_again(t: Trace) -> Any:
    for s in t.last.scheduled:
        if s.request_id in PART_TWO[2:] and s.num_cached_tokens and s.start == s.num_cached_tokens:
            return f"{s.request_id} found {s.num_cached_tokens} tokens of its system prompt still cached"
    return None


def _mru_forgot(t: Trace) -> Any:
    for s in t.last.scheduled:
        if s.request_id in PART_TWO[2:] and s.start == 0 and s.num_cached_tokens == 0 and s.kind == "prefill":
            return f"{s.request_id} found nothing: MRU gave its system prompt's first block away"
    return None


CHECKPOINTS = [
    Checkpoint("more requests than seats: some wait", _queue, "press n until the waiting queue fills"),
    Checkpoint("under priority, the late urgent request r4 overtakes r0", _overtakes,
               "run with --scheduling-policy priority and press n until r4 is admitted", variants=("priority",)),
    Checkpoint(f"with fair share, client {LONE}'s one request is admitted before client {GREEDY}'s queue",
               _takes_turns, "run with --fair-share and press n until r4 is admitted", variants=("fair-share",)),
    Checkpoint("the pool runs dry and the victim policy picks who gives way", _preempted,
               "keep pressing n until ⚠ preempted shows in the event log"),
    Checkpoint("an alternating system prompt is found in the cache again (LRU)", _hit_again,
               "run on into part two, where requests alternate two system prompts",
               variants=("fcfs", "priority", "most-blocks", "fair-share")),
    Checkpoint("with MRU, a system prompt that was just used is gone", _mru_forgot,
               "run with --eviction-policy mru into part two", variants=("mru",)),
    every_request_finished(SCENARIO),
]

QUIZ = [
    QuizQuestion(
        "Under --scheduling-policy priority, which request is admitted first?",
        ("The one with the highest priority value", "The one with the lowest priority value, then the earliest",
         "The shortest prompt", "The one that arrived last"),
        1,
        "vLLM's rule: lower values first, ties by arrival. Here r4 (priority -1) waited "
        "{{measured.r4_wait_priority}} steps instead of {{measured.r4_wait_fcfs}} under FCFS, and r0 (priority 5) "
        "waited {{measured.r0_wait_priority}} instead of {{measured.r0_wait_fcfs}}."),
    QuizQuestion(
        "Preempting the request that holds the most blocks frees the most room at once. What does it cost?",
        ("Nothing", "The most work thrown away: its tokens are recomputed",
         "It changes the greedy output", "It turns prefix caching off"),
        1,
        "most-blocks preempted {{measured.most_blocks_victim}} ({{measured.most_blocks_victim_blocks}} blocks) "
        "and recomputed {{measured.most_blocks_recomputed}} tokens in {{measured.most_blocks_steps}} steps; "
        "vLLM's newest-first preempted {{measured.fcfs_victim}} and recomputed {{measured.fcfs_recomputed}} "
        "tokens in {{measured.fcfs_steps}} steps. The tokens were the same either way."),
    QuizQuestion(
        "Requests alternate two system prompts and the pool cannot keep both whole. Why does MRU find nothing?",
        ("MRU never caches", "A request frees its blocks tail first, so the block freed last is the chain's "
         "first block, and MRU evicts it first: without its first block a prefix cannot be found",
         "MRU is slower", "The hashes differ under MRU"),
        1,
        "LRU found {{measured.lru_hit_per_repeat}} of {{measured.sys_tokens}} system-prompt tokens on every repeat "
        "(hit rate {{measured.fcfs_repeat_hit_rate:.0%}}); MRU found {{measured.mru_hit_per_repeat}} "
        "({{measured.mru_repeat_hit_rate:.0%}})."),
    QuizQuestion(
        "Under --fair-share, client A sent four requests at once and client B one, later. A seat frees while "
        "requests of both wait. Who is admitted?",
        ("A's oldest request: first come, first served", "B's request: admission takes turns between clients, "
         "and B has not had one", "Whichever prompt is shortest", "Nobody: A holds too many blocks"),
        1,
        "Round robin across clients, the client admitted longest ago first. r4 waited "
        "{{measured.r4_wait_fair_share}} steps instead of {{measured.r4_wait_fcfs}}; A's r3 waited "
        "{{measured.r3_wait_fair_share}} instead of {{measured.r3_wait_fcfs}}. Requests that name no client "
        "(part two) are one client, and run exactly as without fair share."),
]
