"""Lesson 1: paged KV blocks versus reserving memory for the longest possible sequence."""
from __future__ import annotations

from typing import Any

from .core import Checkpoint, QuizQuestion, Run, Scenario, Trace, Text, pct, request
from .texts import DOCUMENTS

NUMBER = 1
TITLE = "Paged KV blocks vs contiguous allocation"
SUMMARY = "memory wasted by reserving max length per request versus blocks on demand"

PROMPT_LENS = (244, 130, 296, 170, 260, 200, 110, 230)
MAX_TOKENS = (40, 24, 32, 48, 16, 36, 28, 20)
ARRIVALS = (1, 1, 2, 3, 4, 5, 6, 7)

SCENARIO = Scenario(
    options=dict(block_size=16, num_blocks=128, max_model_len=1024, max_num_seqs=16,
                 max_num_batched_tokens=512, enable_prefix_caching=False),
    requests=tuple(request(f"r{i}", step, Text(DOCUMENTS[i], n), max_tokens=m)
                   for i, (n, m, step) in enumerate(zip(PROMPT_LENS, MAX_TOKENS, ARRIVALS))),
)


def kv_accounting(run: Run) -> dict[str, Any]:
    """Step by step: slots the paged pool allocated, slots holding a token, and what contiguous
    reservations would have held for the same requests at the same time."""
    bs, max_len = run.info.block_size, run.info.max_model_len
    allocated = used = reserved_max_len = reserved_exact = 0
    worst_tail = peak_running = peak_blocks = 0
    for ev, view in run.views():
        holding = [r for r in view.requests.values() if r.blocks]
        for r in holding:
            slots = len(r.blocks) * bs
            allocated += slots
            used += r.num_computed
            worst_tail = max(worst_tail, slots - r.num_computed)
            reserved_max_len += max_len                   # contiguous: the longest sequence the model allows
            reserved_exact += r.prompt_len + r.max_tokens  # contiguous, knowing each request's max_tokens
        peak_running = max(peak_running, len(holding))
        peak_blocks = max(peak_blocks, sum(len(r.blocks) for r in holding))
    return dict(allocated=allocated, used=used, worst_tail=worst_tail, peak_running=peak_running,
                peak_blocks=peak_blocks, reserved_max_len=reserved_max_len, reserved_exact=reserved_exact)


def measure(runs: dict[str, Run]) -> dict[str, Any]:
    run = runs["main"]
    acc = kv_accounting(run)
    pool_slots = run.info.num_blocks * run.info.block_size
    return {
        "num_requests": len(run.outputs),
        "steps": run.num_steps,
        "paged_waste": pct(acc["allocated"] - acc["used"], acc["allocated"]),
        "max_len_waste": pct(acc["reserved_max_len"] - acc["used"], acc["reserved_max_len"]),
        "exact_waste": pct(acc["reserved_exact"] - acc["used"], acc["reserved_exact"]),
        "worst_tail": acc["worst_tail"],
        "peak_running": acc["peak_running"],
        "peak_blocks": acc["peak_blocks"],
        "pool_slots": pool_slots,
        "contiguous_fit": pool_slots // run.info.max_model_len,
        "shortest_prompt": min(PROMPT_LENS),
        "longest_seq": max(n + m for n, m in zip(PROMPT_LENS, MAX_TOKENS)),
        "r0_prompt_blocks": -(-PROMPT_LENS[0] // run.info.block_size),
        "r0_tail": -(-PROMPT_LENS[0] // run.info.block_size) * run.info.block_size - PROMPT_LENS[0],
    }


# ------------------------------------------------------------------------------------ checkpoints

def _r0_has_blocks(t: Trace) -> Any:
    blocks = t.blocks("r0")
    return blocks and f"r0 holds {len(blocks)} blocks: {blocks}"


def _grew_a_block(t: Trace) -> Any:
    for s in t.last.scheduled:
        if s.kind == "decode" and t.last.kv.allocated.get(s.request_id):
            return f"{s.request_id} took block {t.last.kv.allocated[s.request_id][0]} at step {t.last.step}"
    return None


def _scattered(t: Trace) -> Any:
    for rid, r in t.view.requests.items():
        b = r.blocks
        if len(b) > 1 and any(y != x + 1 for x, y in zip(b, b[1:])):
            return f"{rid}: {b}"
    return None


def _reused_after_finish(t: Trace) -> Any:
    freed = {b for ev in t.events[:-1] for blocks in ev.kv.freed_on_finish.values() for b in blocks}
    for rid, blocks in t.last.kv.allocated.items():
        again = sorted(set(blocks) & freed)
        if again:
            return f"{rid} got block(s) {again}, freed by a finished request"
    return None


def _all_done(t: Trace) -> Any:
    done = t.view.requests and all(r.state == "finished" for r in t.view.requests.values())
    if not done or len(t.view.requests) < len(SCENARIO.requests):
        return None
    acc = kv_accounting(Run("live", t.info, t.events))
    return f"your run: paged waste {acc['allocated'] - acc['used']} of {acc['allocated']} slot-steps " \
           f"({pct(acc['allocated'] - acc['used'], acc['allocated']):.1%})"


CHECKPOINTS = [
    Checkpoint("r0's prompt gets just the blocks it needs, no more", _r0_has_blocks,
               "press n once; select r0 (arrow keys) and count its blocks in the map"),
    Checkpoint("a decoding request fills its last block and takes one new block", _grew_a_block,
               "keep pressing n and watch the event log; a request's block count grows by one"),
    Checkpoint("a request's blocks are scattered over the pool, not one contiguous run", _scattered,
               "select a request that has been decoding for a while; its lit cells are not side by side"),
    Checkpoint("a finished request's blocks go straight to a request that needs them", _reused_after_finish,
               "run on (space) until requests finish; new blocks reuse their ids"),
    Checkpoint("every request finished; the panel shows your run's waste", _all_done,
               "let the run finish"),
]

QUIZ = [
    QuizQuestion(
        "With blocks of {{config.block_size}} tokens, how much memory can one request waste at most?",
        ("Nothing: paging stores tokens exactly", "Up to {{config.block_size}} - 1 slots, in its last block",
         "Half of its blocks", "Whatever its max_tokens leaves unused"),
        1,
        "Only the last block of a request can be partly empty; all others are full. The most your run "
        "wasted for one request at one step was {{measured.worst_tail}} slots."),
    QuizQuestion(
        "Why could a contiguous allocator run only {{measured.contiguous_fit}} of these requests at a time "
        "in the same memory?",
        ("It must reserve max_model_len = {{config.max_model_len}} slots per request up front",
         "Contiguous memory is slower", "It cannot share prompts", "It needs a bigger block size"),
        0,
        "It does not know how long a sequence will grow, so it reserves the longest possible one. The pool "
        "holds {{measured.pool_slots}} slots = {{measured.contiguous_fit}} x {{config.max_model_len}}. The "
        "paged run held {{measured.peak_running}} requests at once."),
    QuizQuestion(
        "With blocks of 16 tokens, a request's block table is 7, 2, 30. Where is its token 20?",
        ("Block 7, slot 4", "Block 2, slot 4", "Block 30, slot 20", "Block 2, slot 20"),
        1,
        "Token t lives in block table[t // block_size] at offset t % block_size: 20 // 16 = 1 -> block 2, "
        "20 % 16 = 4. Attention follows the block table, so the blocks need not be adjacent."),
]
