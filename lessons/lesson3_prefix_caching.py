"""Lesson 3: automatic prefix caching with a shared system prompt."""
from __future__ import annotations

from typing import Any

from minipaged.events import PrefixLookup, describe_prefix_lookup

from .core import Checkpoint, OneTokenChanged, QuizQuestion, Run, Scenario, Trace, Text, pct, request
from .texts import DOCUMENTS, OTHER_SYSTEM, QUESTIONS, SYSTEM

NUMBER = 3
TITLE = "Prefix caching"
SUMMARY = "a shared system prompt: hits, shared blocks, LRU eviction, why a block missed"

SYS = Text(SYSTEM, 192)                 # the shared system prompt: 12 full blocks of 16 tokens
SYS_EDITED = OneTokenChanged(SYSTEM, 192, position=100, word=" Monday")   # the same but for one token

SCENARIO = Scenario(
    options=dict(block_size=16, num_blocks=32, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=512),
    requests=(
        request("r0", 1, SYS, Text(QUESTIONS[0], 40), max_tokens=16),
        request("r1", 1, Text(DOCUMENTS[0], 150), max_tokens=24),         # no system prompt: takes room
        request("r2", 3, SYS, Text(QUESTIONS[1], 56), max_tokens=8),      # 16 blocks, 12 of them cached
        request("r3", 5, SYS, Text(QUESTIONS[2], 20), max_tokens=10),
        request("r4", 7, SYS, Text(QUESTIONS[3], 30), max_tokens=8),
        request("r5", 30, SYS, Text(QUESTIONS[4], 24), max_tokens=6),     # after everyone else finished
        request("r6", 40, Text(OTHER_SYSTEM, 100), Text(DOCUMENTS[1], 200), max_tokens=6),   # needs room
        request("r7", 50, SYS, Text(QUESTIONS[5], 28), max_tokens=6),
        request("r8", 60, SYS_EDITED, Text(QUESTIONS[6], 24), max_tokens=6),  # one token differs at 100
        request("r9", 62, Text(DOCUMENTS[0], 150), max_tokens=6),         # r1's prompt again, after r6
    ),
    variants={"cache-on": {}, "cache-off": {"enable_prefix_caching": False}},
)


def admission(run: Run, rid: str) -> dict[str, Any]:
    """Step, cached tokens and blocks, and free blocks just before the request was admitted."""
    step = run.first_scheduled_step(rid)
    ev = run.event(step)
    s = next(s for s in ev.scheduled if s.request_id == rid)
    free_before = run.event(step - 1).num_free_blocks if step > 1 else run.info.num_blocks
    return dict(step=step, cached=s.num_cached_tokens, hit_blocks=len(ev.kv.cache_hits.get(rid, [])),
                blocks=len(ev.kv.allocated.get(rid, [])), free_before=free_before,
                waited=step - run.arrival_step(rid))


def lookup(run: Run, rid: str) -> PrefixLookup:
    """What the prefix cache said when the request was admitted (its ScheduledRequest's ``prefix_lookup``)."""
    return next(s.prefix_lookup for ev in run.events for s in ev.scheduled
                if s.request_id == rid and s.prefix_lookup is not None)


def measure(runs: dict[str, Run]) -> dict[str, Any]:
    on, off = runs["cache-on"], runs["cache-off"]
    bs = on.info.block_size
    prompt_tokens = sum(r.prompt_len for r in SCENARIO.requests)
    r2, r2_off, r5, r7 = admission(on, "r2"), admission(off, "r2"), admission(on, "r5"), admission(on, "r7")
    r6_step = on.first_scheduled_step("r6")
    max_share = 0
    for _ev, view in on.views():
        max_share = max(max_share, max(len(o) for o in view.block_owners))
    counters = on.events[-1].counters
    r2_miss, r8_miss, r9_miss = lookup(on, "r2"), lookup(on, "r8"), lookup(on, "r9")
    return {
        "sys_tokens": SYS.num_tokens,
        "sys_blocks": SYS.num_tokens // bs,
        "extra_shared": bs // 2,
        "sys_plus_extra": SYS.num_tokens + bs // 2,
        "sys_plus_block": SYS.num_tokens + bs,
        "prompt_tokens": prompt_tokens,
        "hit_rate": round(counters["prefix_cache_hit_rate"], 4),
        "hit_tokens": int(counters["prefix_cache_hits"]),
        "prefill_on": on.prefill_tokens,
        "prefill_off": off.prefill_tokens,
        "prefill_saved": off.prefill_tokens - on.prefill_tokens,
        "prefill_saved_share": pct(off.prefill_tokens - on.prefill_tokens, off.prefill_tokens),
        "steps_on": on.num_steps,
        "steps_off": off.num_steps,
        "r2_blocks": r2["blocks"],
        "r2_hit_blocks": r2["hit_blocks"],
        "r2_new_blocks": r2["blocks"] - r2["hit_blocks"],
        "r2_free_before": r2["free_before"],
        "r2_step": r2["step"],
        "r2_step_off": r2_off["step"],
        "r2_waited_off": r2_off["waited"],
        "max_share": max_share,
        "r5_cached": r5["cached"],
        "r6_step": r6_step,
        "r6_evicted": len(on.event(r6_step).kv.evicted),
        "evictions": int(counters["blocks_evicted"]),
        "r7_cached": r7["cached"],
        "r1_miss": lookup(on, "r1").reason,
        "r2_miss": r2_miss.reason,
        "r2_differs_at": r2_miss.differs_at,
        "r8_miss": r8_miss.reason,
        "r8_differs_at": r8_miss.differs_at,
        "r8_hit_blocks": r8_miss.num_hit_blocks,
        "r8_recomputed_sys_blocks": SYS.num_tokens // bs - r8_miss.num_hit_blocks,
        "sys_blocks_but_one": SYS.num_tokens // bs - 1,
        "r9_miss": r9_miss.reason,
        "r9_hit_blocks": r9_miss.num_hit_blocks,
        "r9_blocks": r9_miss.num_blocks,
        "r9_evicted_step": r9_miss.evicted_step,
        "r9_evicted_for": r9_miss.evicted_for,
    }


# ------------------------------------------------------------------------------------ checkpoints

def _cached(t: Trace) -> Any:
    blocks = t.last.kv.cached
    return blocks and f"step {t.last.step}: blocks {blocks[:6]}{'…' if len(blocks) > 6 else ''} got a hash"


def _hit(t: Trace) -> Any:
    for s in t.last.scheduled:
        if s.num_cached_tokens:
            hits = t.last.kv.cache_hits.get(s.request_id, [])
            new = len(t.last.kv.allocated.get(s.request_id, [])) - len(hits)
            free = t.events[-2].num_free_blocks if len(t.events) > 1 else t.info.num_blocks
            return (f"{s.request_id}: {len(hits)} blocks reused ({s.num_cached_tokens} tokens), {new} new; "
                    f"{free} blocks were free")
    return None


def _shared3(t: Trace) -> Any:
    for b, owners in enumerate(t.view.block_owners):
        if len(owners) >= 3:
            return f"block {b} is read by {', '.join(owners)}"
    return None


def _hit_on_free_blocks(t: Trace) -> Any:
    for rid, hits in t.last.kv.cache_hits.items():
        if hits and all(not t.before_owners[b] for b in hits):
            return f"{rid} revived {len(hits)} cached blocks that no request held"
    return None


def _evicted(t: Trace) -> Any:
    """r6's long prompt of its own is what needs the room (short prompts evict a block here and there too)."""
    ev = t.last.kv.evicted
    if ev and "r6" in t.admitted():
        return f"step {t.last.step}: r6 evicted {len(ev)} cached block(s), least recently used first"
    return None


def _hit_after_eviction(t: Trace) -> Any:
    if "r7" not in t.admitted() or not any("r6" in ev.kv.allocated for ev in t.events):
        return None
    r7 = next(s for s in t.last.scheduled if s.request_id == "r7")
    if r7.num_cached_tokens >= SYS.num_tokens:
        return f"r7 found all {r7.num_cached_tokens} system-prompt tokens still cached"
    return None


def _miss(t: Trace, rid: str, reason: str) -> Any:
    """The request was admitted this step and its event says why its first missing block missed."""
    if rid not in t.admitted():
        return None
    found = t.view.requests[rid].prefix_lookup
    if found is None or found.reason != reason:
        return None
    return f"{rid}: {describe_prefix_lookup(found)}"


def _no_cache_wait(t: Trace) -> Any:
    if "r2" in t.admitted():
        req = t.view.requests["r2"]
        return f"r2 needed all {len(req.blocks)} blocks free and was admitted at step {t.last.step}"
    return None


CHECKPOINTS = [
    Checkpoint("r0's full prompt blocks get a hash: they are now in the prefix cache", _cached,
               "press n once; the blocks of r0's system prompt are now shareable", variants=("cache-on",)),
    Checkpoint("a request is admitted reusing cached blocks (a cache hit)", _hit,
               "press n until r2 is admitted; which blocks did it reuse?", variants=("cache-on",)),
    Checkpoint("one block is shared by three requests (x3 in the map)", _shared3,
               "keep pressing n until r3 is running too", variants=("cache-on",)),
    Checkpoint("a prompt hits cached blocks that nobody was using any more", _hit_on_free_blocks,
               "run on (space) until everyone has finished and r5 arrives", variants=("cache-on",)),
    Checkpoint("a long prompt evicts cached blocks, least recently used first", _evicted,
               "watch for ✗ evicted in the event log when r6 arrives", variants=("cache-on",)),
    Checkpoint("after the eviction, r7 still finds the whole system prompt cached", _hit_after_eviction,
               "let r7 arrive; count its cached tokens in the Requests table", variants=("cache-on",)),
    Checkpoint("one changed token in r8's system prompt: every block from it on misses",
               lambda t: _miss(t, "r8", "differs"),
               "let r8 arrive and select it: the Output panel says where its tokens differ", variants=("cache-on",)),
    Checkpoint("r1's prompt comes back as r9, but r6 evicted its blocks: the miss names the step and the request",
               lambda t: _miss(t, "r9", "evicted"), "let r9 arrive and select it", variants=("cache-on",)),
    Checkpoint("without the cache, r2 has to wait until all its blocks are free", _no_cache_wait,
               "run with --no-prefix-caching and press n until r2 is admitted", variants=("cache-off",)),
]

QUIZ = [
    QuizQuestion(
        "r2's prompt fills {{measured.r2_blocks}} blocks and {{measured.r2_hit_blocks}} are cached. How many "
        "free blocks must the pool have to admit it?",
        ("{{measured.r2_blocks}}", "{{measured.r2_new_blocks}}", "{{measured.r2_hit_blocks}}", "none"),
        1,
        "Only blocks it does not find in the cache: {{measured.r2_new_blocks}}. The pool had "
        "{{measured.r2_free_before}} free, so r2 was admitted at once. Without caching it waited "
        "{{measured.r2_waited_off}} steps."),
    QuizQuestion(
        "r0 and r2 share the {{measured.sys_tokens}}-token system prompt ({{measured.sys_blocks}} blocks). If "
        "they also shared the next {{measured.extra_shared}} tokens, how many tokens could r2 reuse?",
        ("{{measured.sys_plus_extra}}", "{{measured.sys_tokens}}", "{{measured.sys_plus_block}}", "0"),
        1,
        "Only full blocks are cached, and a block's hash covers all {{config.block_size}} of its tokens. "
        "{{measured.extra_shared}} more shared tokens do not fill a block, so the next block differs: still "
        "{{measured.sys_tokens}}."),
    QuizQuestion(
        "The pool needs a block and every free block still holds a cached prefix. Which one goes first?",
        ("The one with the most hits", "A random one", "The one freed longest ago (least recently used)",
         "The system prompt's first block"),
        2,
        "Freed blocks join the back of the free queue and new blocks come from the front: LRU. A popular "
        "system prompt is freed last (its last user finished most recently), so it survived r6's eviction "
        "of {{measured.r6_evicted}} blocks."),
    QuizQuestion(
        "r8's system prompt is the cached one with token {{measured.r8_differs_at}} changed (a date, say). How "
        "many of the system prompt's {{measured.sys_blocks}} blocks does r8 find cached?",
        ("{{measured.sys_blocks_but_one}}", "{{measured.r8_hit_blocks}}", "0", "{{measured.sys_blocks}}"),
        1,
        "{{measured.r8_hit_blocks}}: the blocks before the change. A block's hash chains every token before it, "
        "so the {{measured.r8_recomputed_sys_blocks}} system-prompt blocks from the one holding token "
        "{{measured.r8_differs_at}} on are all new, though their tokens after it are the same."),
]
