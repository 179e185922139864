"""Lesson 5: preemption in an oversubscribed pool: recompute versus swap, and what to tune."""
from __future__ import annotations

from typing import Any

from .core import Checkpoint, QuizQuestion, Run, Scenario, Trace, Text, request
from .texts import DOCUMENTS

NUMBER = 5
TITLE = "Preemption: recompute vs swap"
SUMMARY = "an oversubscribed pool; recompute vs swap; what to tune"

LENGTHS = ((40, 40), (56, 32), (36, 44), (48, 36), (30, 40), (44, 28))   # (prompt, max_tokens)

SCENARIO = Scenario(
    # Prefix caching is off so that a recompute really recomputes (with it on, a preempted request can find
    # its own freed blocks still cached).
    options=dict(block_size=16, num_blocks=24, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=256,
                 enable_prefix_caching=False, num_cpu_blocks=32),
    requests=tuple(request(f"r{i}", 1 + 2 * i, Text(DOCUMENTS[i], n), max_tokens=m)
                   for i, (n, m) in enumerate(LENGTHS)),
    variants={"recompute": {}, "swap": {"preemption_mode": "swap"}, "roomy": {"num_blocks": 64},
              "fewer-seqs": {"max_num_seqs": 3}},
)


def measure(runs: dict[str, Run]) -> dict[str, Any]:
    base = runs["roomy"]
    out: dict[str, Any] = {}
    for name, run in runs.items():
        key = name.replace("-", "_")
        out[f"{key}_steps"] = run.num_steps
        out[f"{key}_preemptions"] = run.num_preemptions
        out[f"{key}_prefill"] = run.prefill_tokens
        out[f"{key}_same_outputs"] = run.outputs == base.outputs
    rec, swap = runs["recompute"], runs["swap"]
    first = next(ev for ev in rec.events if ev.preempted)
    victim = first.preempted[0]
    peak = max(sum(len(r.blocks) for r in view.requests.values()) for _e, view in base.views())
    out.update(
        num_requests=len(LENGTHS),
        roomy_blocks=SCENARIO.variants["roomy"]["num_blocks"],
        fewer_seqs=SCENARIO.variants["fewer-seqs"]["max_num_seqs"],
        demand_blocks=sum(-(-(n + m) // rec.info.block_size) for n, m in LENGTHS),
        roomy_peak_blocks=peak,
        first_preemption_step=first.step,
        first_victim=victim.request_id,
        first_victim_blocks=victim.num_blocks,
        first_victim_running=len(first.running) + 1,
        recompute_extra_tokens=rec.prefill_tokens - base.prefill_tokens,
        recompute_extra_share=round((rec.prefill_tokens - base.prefill_tokens) / base.prefill_tokens, 4),
        swap_blocks_out=sum(len(p) for ev in swap.events for p in ev.kv.swapped_out.values()),
        swap_blocks_in=sum(len(p) for ev in swap.events for p in ev.kv.swapped_in.values()),
        swap_extra_tokens=swap.prefill_tokens - base.prefill_tokens,
    )
    return out


# ------------------------------------------------------------------------------------ checkpoints

def _preempted(t: Trace) -> Any:
    p = t.last.preempted
    if not p:
        return None
    newest = max(t.view.requests, key=lambda rid: int(rid[1:]) if t.before.get(rid) == "running" else -1)
    return (f"step {t.last.step}: {p[0].request_id} ({p[0].mode}, {p[0].num_blocks} blocks), "
            f"the newest of the running requests was {newest}")


def _recomputed(t: Trace) -> Any:
    for s in t.last.scheduled:
        req = t.view.requests.get(s.request_id)
        if req and req.num_preemptions and s.kind == "prefill" and s.start == 0 and s.end > s.prompt_len:
            return (f"{s.request_id} recomputed {s.end} tokens: its {s.prompt_len}-token prompt and "
                    f"{s.end - s.prompt_len} tokens it had generated")
    return None


def _swapped_out(t: Trace) -> Any:
    for rid, pairs in t.last.kv.swapped_out.items():
        return f"{rid}: KV blocks {[g for g, _ in pairs]} copied to host-pool blocks {[c for _, c in pairs]}"
    return None


def _swapped_in(t: Trace) -> Any:
    for rid, pairs in t.last.kv.swapped_in.items():
        return f"{rid}: back into KV blocks {[g for _, g in pairs]}, nothing recomputed"
    return None


def _all_done(t: Trace) -> Any:
    n = sum(len(ev.preempted) for ev in t.events)
    return t.all_complete(SCENARIO) and (f"your run: {n} preemption(s), {len(t.events)} steps, every request got "
                                         "all its tokens")


def _no_preemption(t: Trace) -> Any:
    if any(ev.preempted for ev in t.events):
        return None
    return _all_done(t) and f"{len(t.events)} steps and not a single preemption"


CHECKPOINTS = [
    Checkpoint("the pool runs dry and the newest running request is preempted", _preempted,
               "press n (or run with space) until ⚠ preempted shows in the event log",
               variants=("recompute", "swap")),
    Checkpoint("the preempted request comes back and recomputes its prompt and its generated tokens",
               _recomputed, "keep going until it is admitted again", variants=("recompute",)),
    Checkpoint("a preempted request's blocks are copied to the host pool", _swapped_out,
               "watch the host-pool map under the KV map", variants=("swap",)),
    Checkpoint("the swapped request comes back without recomputing anything", _swapped_in,
               "keep going until ⇄ swapped in", variants=("swap",)),
    Checkpoint("every request finished with all its tokens", _all_done, "let the run finish"),
    Checkpoint("with more blocks (or fewer sequences), nobody is preempted", _no_preemption,
               "run with --num-blocks {{measured.roomy_blocks}} or --max-num-seqs {{measured.fewer_seqs}}",
               variants=("roomy", "fewer-seqs")),
]

QUIZ = [
    QuizQuestion(
        "The pool is full and a running request needs one more block. Whom does the scheduler preempt?",
        ("The request that needs the block", "The oldest running request",
         "The most recently arrived running request", "The request with the most blocks"),
        2,
        "First come, first served: the newest arrival gives way, so older requests keep their progress. "
        "Here {{measured.first_victim}} was preempted first, at step {{measured.first_preemption_step}}."),
    QuizQuestion(
        "Recompute or swap: which one spends compute, and which one spends memory traffic?",
        ("Recompute spends compute (prefill again); swap copies KV blocks to CPU and back",
         "Both recompute", "Swap spends compute; recompute copies blocks", "Neither costs anything"),
        0,
        "Recompute ran {{measured.recompute_extra_tokens}} extra prefill tokens; swap instead copied "
        "{{measured.swap_blocks_out}} blocks out and {{measured.swap_blocks_in}} back. Both gave the same "
        "outputs as a run without preemption."),
    QuizQuestion(
        "vLLM's optimization-and-tuning guide lists what to do when preemptions are frequent. Which change is "
        "NOT on its list?",
        ("More KV cache memory (gpu_memory_utilization, num_blocks)", "A smaller max_num_seqs",
         "A smaller max_num_batched_tokens", "A larger block_size"),
        3,
        "The warning itself names more memory (gpu_memory_utilization, tensor_parallel_size); the guide adds "
        "fewer requests at once (max_num_seqs, max_num_batched_tokens). Here {{measured.roomy_blocks}} instead of {{config.num_blocks}} "
        "blocks left {{measured.roomy_preemptions}} preemptions, and so did max_num_seqs {{measured.fewer_seqs}} "
        "({{measured.fewer_seqs_preemptions}}), but then the run took {{measured.fewer_seqs_steps}} steps "
        "instead of {{measured.recompute_steps}}."),
]
