"""Lesson 2: continuous batching versus static batching on the same workload."""
from __future__ import annotations

from typing import Any, Optional

from .core import Checkpoint, QuizQuestion, Run, Scenario, Trace, Text, request
from .texts import QUESTIONS

NUMBER = 2
TITLE = "Continuous vs static batching"
SUMMARY = "the same workload under policy='static' and continuous batching"

# Mixed output lengths: a few long answers among many short ones, as in real chat traffic.
MAX_TOKENS = (32, 3, 5, 2, 30, 4, 2, 5, 28, 3, 4, 3, 3, 6, 3, 4)
PROMPT_LENS = (24, 18, 30, 20, 26, 22, 19, 28, 21, 25, 23, 27, 17, 29, 22, 20)

SCENARIO = Scenario(
    options=dict(block_size=16, num_blocks=64, max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=256),
    requests=tuple(request(f"r{i}", 1, Text(QUESTIONS[i], n), max_tokens=m)
                   for i, (n, m) in enumerate(zip(PROMPT_LENS, MAX_TOKENS))),
    variants={"continuous": {}, "static": {"policy": "static"}},
)


def timeline(run: Run, width: int) -> str:
    """The batch's slots step by step, drawn from events: each request keeps its slot while it runs and is
    labelled by its id; ``·`` is a slot with nobody in it."""
    slots: list[list[str]] = [[] for _ in range(run.info.max_num_seqs)]
    holder: list[Optional[str]] = [None] * run.info.max_num_seqs
    for ev in run.events[:width]:
        running = {s.request_id for s in ev.scheduled}
        for i, rid in enumerate(holder):
            if rid is not None and rid not in running:
                holder[i] = None
        for rid in sorted(running - set(holder), key=lambda r: int(r[1:])):
            holder[holder.index(None)] = rid
        for i, rid in enumerate(holder):
            slots[i].append(rid or "·")
    lines = []
    for i, cells in enumerate(slots):
        row, k = [], 0
        while k < len(cells):
            rid, n = cells[k], 1
            while k + n < len(cells) and cells[k + n] == rid:
                n += 1
            row.append("·" * n if rid == "·" else (rid + "━" * n)[:n])
            k += n
        more = "…" if run.num_steps > width else ""
        lines.append(f"slot {i} " + "".join(row) + more)
    return "\n".join(lines)


def idle_share(run: Run) -> float:
    slots = run.info.max_num_seqs
    busy = sum(len(ev.scheduled) for ev in run.events)
    return round(1 - busy / (slots * run.num_steps), 4)


def measure(runs: dict[str, Run]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, run in runs.items():
        out[f"{name}_steps"] = run.num_steps
        out[f"{name}_tokens_per_step"] = round(run.generated_tokens / run.num_steps, 2)
        out[f"{name}_idle"] = idle_share(run)
    cont, static = runs["continuous"], runs["static"]
    width = cont.num_steps
    out.update(
        num_requests=len(cont.outputs),
        first_waiting=len(static.events[0].waiting),
        generated_tokens=cont.generated_tokens,
        long_requests=sum(1 for m in MAX_TOKENS if m >= 20),
        longest=max(MAX_TOKENS),
        shortest=min(MAX_TOKENS),
        speedup=round(out["continuous_tokens_per_step"] / out["static_tokens_per_step"], 2),
        outputs_equal=cont.outputs == static.outputs,
        timeline_steps=width,
        continuous_timeline=timeline(cont, width),
        static_timeline=timeline(static, width),
        static_second_batch=static.first_scheduled_step("r4"),
        continuous_r4_start=cont.first_scheduled_step("r4"),
        r3_finish=cont.finish_step("r3"),
    )
    return out


# ------------------------------------------------------------------------------------ checkpoints

def _finish_while_others_run(t: Trace) -> Any:
    ev = t.last
    if ev.finished and ev.running:
        return f"step {ev.step}: {ev.finished[0].request_id} done, {', '.join(ev.running)} still running"
    return None


def _slot_refilled(t: Trace) -> Any:
    if len(t.events) < 2 or not t.events[-2].finished:
        return None
    new = t.admitted()
    return new and f"step {t.last.step}: {', '.join(new)} took the freed slot at once"


def _mixed_step(t: Trace) -> Any:
    kinds = {s.kind for s in t.last.scheduled}
    if kinds == {"prefill", "decode"}:
        pre = [s.request_id for s in t.last.scheduled if s.kind == "prefill"]
        return f"step {t.last.step}: {', '.join(pre)} prefilled beside {t.last.num_decode_tokens} decodes"
    return None


def _idle_slot_while_waiting(t: Trace) -> Any:
    ev = t.last
    idle = ev.max_num_seqs - len(ev.scheduled)
    if ev.waiting and idle > 0 and ev.scheduled:
        return f"step {ev.step}: {idle} of {ev.max_num_seqs} slots idle, {len(ev.waiting)} requests waiting"
    return None


def _next_batch(t: Trace) -> Any:
    new = t.admitted()
    if len(t.events) > 1 and new and not t.events[-2].running:
        return f"step {t.last.step}: batch {', '.join(new)} starts after the whole previous batch finished"
    return None


def _all_done(t: Trace) -> Any:
    if len(t.view.requests) < len(SCENARIO.requests) or any(r.state != "finished" for r in
                                                             t.view.requests.values()):
        return None
    tokens = sum(len(v) for ev in t.events for v in ev.new_token_ids.values())
    return f"your run: {tokens} tokens in {len(t.events)} steps = {tokens / len(t.events):.2f} tokens/step"


CHECKPOINTS = [
    Checkpoint("a short request finishes while a long one keeps going", _finish_while_others_run,
               "press n a few times; watch the event log for ■ finished"),
    Checkpoint("in the very next step a waiting request takes the freed slot", _slot_refilled,
               "press n once more after a finish: ▶ admitted", variants=("continuous",)),
    Checkpoint("a new request's prefill runs in the same step as the others' decodes", _mixed_step,
               "look at the Batch panel: prefill and decode rows together", variants=("continuous",)),
    Checkpoint("slots sit idle while requests wait: nobody joins a running static batch",
               _idle_slot_while_waiting, "press n until a short request finishes, then watch the queue",
               variants=("static",)),
    Checkpoint("the next batch starts only when the whole batch has finished", _next_batch,
               "run on (space) until the long request of the first batch ends", variants=("static",)),
    Checkpoint("every request finished; the panel shows your run's tokens per step", _all_done,
               "let the run finish"),
]

QUIZ = [
    QuizQuestion(
        "In the static run, what decides how long a batch takes?",
        ("The average output length", "The longest request in the batch", "The number of requests waiting",
         "The prompt lengths"),
        1,
        "A static batch ends with its longest request: here the first batch waits for r0's "
        "{{measured.longest}} tokens while its short neighbours are long gone."),
    QuizQuestion(
        "Why does continuous batching give the same tokens as static batching for every request?",
        ("It does not: batching changes the answers",
         "Each request's tokens depend only on its own prompt and sampling, not on its neighbours in the batch",
         "Because both runs use the same number of steps", "Because the prompts are short"),
        1,
        "Attention never mixes requests: each reads only its own KV blocks. Greedy outputs are identical "
        "in both runs (a test checks it); only when each token is produced changes."),
    QuizQuestion(
        "Continuous batching gave {{measured.speedup}}x the tokens per step here. When would the gain be "
        "smallest?",
        ("When all requests want the same number of tokens", "When output lengths vary a lot",
         "When requests arrive one by one", "When max_num_seqs is large"),
        0,
        "If every request finishes at the same step, a static batch never has idle slots. The gain comes from "
        "mixed lengths: static batching left {{measured.static_idle:.0%}} of slot-steps idle here."),
]
