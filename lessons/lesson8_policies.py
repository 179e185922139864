"""Lesson 8: who waits, who is evicted: request order, preemption victim and prefix eviction as policies."""
from __future__ import annotations

from typing import Any

from .core import Checkpoint, QuizQuestion, Run, Scenario, Text, Trace, every_request_finished, pct, request
from .texts import DOCUMENTS, OTHER_SYSTEM, QUESTIONS, SYSTEM

NUMBER = 8
TITLE = "Who waits, who is evicted"
SUMMARY = "policies: FCFS vs priority, the preemption victim, LRU vs MRU eviction"

SYS_A, SYS_B = Text(SYSTEM, 128), Text(OTHER_SYSTEM, 128)     # two system prompts of 8 blocks each
NUM_ALTERNATING = 8

SCENARIO = Scenario(
    options=dict(block_size=16, num_blocks=14, max_model_len=1024, max_num_seqs=3, max_num_batched_tokens=256),
    requests=(
        # Part one: more requests than seats, and a pool too small for all of them to grow.
        request("r0", 1, Text(DOCUMENTS[0], 40), max_tokens=40, priority=5),      # low priority
        request("r1", 1, Text(DOCUMENTS[1], 56), max_tokens=32),
        request("r2", 1, Text(DOCUMENTS[2], 36), max_tokens=44),
        request("r3", 1, Text(DOCUMENTS[3], 48), max_tokens=36),
        request("r4", 6, Text(DOCUMENTS[4], 30), max_tokens=20, priority=-1),     # late and urgent
        # Part two, after part one has finished: one request at a time, alternating two system prompts.
        *(request(f"s{i}", 300 + 100 * i, SYS_A if i % 2 == 0 else SYS_B, Text(QUESTIONS[i], 16), max_tokens=8)
          for i in range(NUM_ALTERNATING)),
    ),
    variants={"fcfs": {}, "priority": {"scheduling_policy": "priority", "preemption_victim": "lowest-priority"},
              "most-blocks": {"preemption_victim": "most-blocks"}, "mru": {"eviction_policy": "mru"}},
)
PART_ONE = ("r0", "r1", "r2", "r3", "r4")
PART_TWO = tuple(f"s{i}" for i in range(NUM_ALTERNATING))


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


def measure(runs: dict[str, Run]) -> dict[str, Any]:
    fcfs, prio, most, mru = runs["fcfs"], runs["priority"], runs["most-blocks"], runs["mru"]
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
    Checkpoint("the pool runs dry and the victim policy picks who gives way", _preempted,
               "keep pressing n until ⚠ preempted shows in the event log"),
    Checkpoint("an alternating system prompt is found in the cache again (LRU)", _hit_again,
               "run on into part two, where requests alternate two system prompts",
               variants=("fcfs", "priority", "most-blocks")),
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
]
