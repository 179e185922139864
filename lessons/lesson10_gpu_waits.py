"""Lesson 10: why the GPU waits: each step is the host's work (scheduling, the batch's tensors, sampling, text)
and the forward pass; on a fast device the host's part is most of the step. Async output processing (vLLM v0's;
not vLLM v1's async scheduling) overlaps the output processing with the next forward pass."""
from __future__ import annotations

import os
import statistics
import tempfile
from typing import Any

from minipaged.events import StepEvent

from .core import (Checkpoint, QuizQuestion, Run, Scenario, Text, Trace, build_lesson_model, decode_steps, decodes,
                   every_request_finished, request, run_variant)
from .texts import DOCUMENTS, QUESTIONS

NUMBER = 10
TITLE = "Why the GPU waits"
SUMMARY = "host time against forward time in each step, with and without async output processing"

ALONE = "r0"
BATCH = tuple(f"r{i + 1}" for i in range(len(QUESTIONS)))       # sixteen short chat questions

SCENARIO = Scenario(
    options=dict(block_size=16, num_blocks=96, max_model_len=512, max_num_seqs=16, max_num_batched_tokens=512),
    requests=(
        # Part one: one request decodes alone: the smallest forward pass, the host's fixed cost per step beside it.
        request(ALONE, 1, Text(DOCUMENTS[1], 32), max_tokens=24),
        # Part two, once r0 has finished: sixteen requests decode together: a bigger forward pass, and more host
        # work per step (each request is scheduled, sampled and turned into text).
        *(request(rid, 100, Text(question, 16), max_tokens=16) for rid, question in zip(BATCH, QUESTIONS)),
    ),
    variants={"sync": {}, "async": {"async_output_processing": True}},
)
PHASES = {"alone": 1, "batch": len(BATCH)}


def schedule(run: Run) -> list[tuple]:
    """What every step computed, token ranges only, leaving out events with nothing scheduled (async output
    processing returns one when a forward pass has just started and none had ended)."""
    return [tuple((s.request_id, s.kind, s.start, s.end) for s in ev.scheduled) for ev in run.events if ev.scheduled]


def measure(runs: dict[str, Run]) -> dict[str, Any]:
    """What does not depend on the machine: step counts, batch sizes, whether both runs computed the same tokens
    (times are machine-dependent: measure_smollm2)."""
    sync, late = runs["sync"], runs["async"]
    return dict(
        num_requests=len(SCENARIO.requests), batch=len(BATCH),
        alone_tokens=SCENARIO.request(ALONE).max_tokens, batch_tokens=SCENARIO.request(BATCH[0]).max_tokens,
        alone_decode_steps=len(decode_steps(sync.events, 1)),
        batch_decode_steps=len(decode_steps(sync.events, len(BATCH))),
        sync_steps=sync.num_steps, async_steps=late.num_steps,
        async_empty_events=sum(1 for ev in late.events if not ev.scheduled),
        same_outputs=sync.outputs == late.outputs, same_schedule=schedule(sync) == schedule(late),
    )


def step_times(run: Run, batch: int) -> dict[str, float]:
    """Seconds per decode step of ``batch`` requests and the forward pass's share of a step's wall time (what the
    TUI's "forward" gauge shows), each the median over the steps: on a shared machine a few steps stretched by
    other programs would weigh on a sum."""
    steps = decode_steps(run.events, batch)
    return {"step": statistics.median(ev.duration_s for ev in steps),
            "host": statistics.median(ev.host_s for ev in steps),
            "forward": statistics.median(ev.forward_s for ev in steps),
            "busy": statistics.median(ev.forward_s / ev.duration_s for ev in steps),
            "host_share": statistics.median(ev.host_s / ev.duration_s for ev in steps)}


def timings(prefix: str, runs: dict[str, Run], unit: float) -> dict[str, float]:
    """Every variant's step, host and forward times alone and in the batch (in ``unit`` seconds), the forward's
    and the host's shares of a step in percent (with async output processing they overlap), and how much faster
    async output processing made a step."""
    name = {1e-3: "ms", 1e-6: "us"}[unit]
    out: dict[str, float] = {}
    for variant, run in runs.items():
        for phase, batch in PHASES.items():
            t = step_times(run, batch)
            key = f"{prefix}_{variant}_{phase}"
            out.update({f"{key}_step_{name}": t["step"] / unit, f"{key}_host_{name}": t["host"] / unit,
                        f"{key}_forward_{name}": t["forward"] / unit, f"{key}_busy_pct": 100 * t["busy"],
                        f"{key}_host_pct": 100 * t["host_share"]})
    for phase in PHASES:
        out[f"{prefix}_{phase}_async_speedup"] = (out[f"{prefix}_sync_{phase}_step_{name}"]
                                                  / out[f"{prefix}_async_{phase}_step_{name}"])
    return out


def measure_smollm2(runs: dict[str, Run]) -> dict[str, float]:
    """Host against forward time on this CPU, both variants: SmolLM2 (``runs``; milliseconds) and the lessons'
    tiny random model, run here in the same call so both come from one machine at one time (microseconds: its
    forward pass is tiny, as a GPU's is beside Python)."""
    out = timings("smollm2", runs, 1e-3)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_lesson_model(os.path.join(tmp, "tiny"))
        out.update(timings("tiny", {name: run_variant(SCENARIO, tiny, name) for name in SCENARIO.variants}, 1e-6))
    return out


# ------------------------------------------------------------------------------------ checkpoints

def _split(ev: StepEvent) -> str:
    """A step's wall time split into forward and host time, and the forward pass's share of it. With async output
    processing the forward pass that ends in a step began in the step before (the model thread runs it beside the
    host's work), so it can be longer than the step: the whole step was then busy, 100%, and the line says why
    (a class trial read "forward busy 124%", unexplained)."""
    busy = 100 * ev.forward_s / ev.duration_s if ev.duration_s else 0.0
    line = (f"{1e3 * ev.duration_s:.2f} ms: forward {1e3 * ev.forward_s:.2f} ms, host {1e3 * ev.host_s:.2f} ms "
            f"(forward busy {min(busy, 100.0):.0f}%")
    if ev.forward_s > ev.duration_s:
        line += (": this forward pass began in the step before, beside the host's work (async output "
                 "processing), so it is longer than the step that waited for it")
    return line + ")"


def _timed(ev: StepEvent) -> bool:
    return ev.forward_s is not None and ev.host_s is not None


def _alone(t: Trace) -> Any:
    ev = t.last
    if decodes(ev) != 1 or not _timed(ev):
        return None
    return f"step {ev.step}: {ev.scheduled[0].request_id} alone, {_split(ev)}"


def _batched(t: Trace) -> Any:
    ev, n = t.last, decodes(t.last)
    alone = [e for e in decode_steps(t.events, 1) if _timed(e)]
    if n < 2 or not alone or not _timed(ev):
        return None
    host = statistics.median(e.host_s for e in alone)
    forward = statistics.median(e.forward_s for e in alone)
    return (f"step {ev.step}: {n} requests, {_split(ev)}; alone: forward {1e3 * forward:.2f} ms, "
            f"host {1e3 * host:.2f} ms")


def _one_step_late(t: Trace) -> Any:
    if not t.info.async_output_processing or len(t.events) < 2 or t.events[0].scheduled or not t.events[1].scheduled:
        return None
    first, second = t.events[:2]
    return (f"step {first.step} returned nothing scheduled ({len(first.arrivals)} arrival(s)): "
            f"{second.scheduled[0].request_id}'s forward pass was in flight; step {second.step} returned it")


CHECKPOINTS = [
    Checkpoint("r0 decodes alone: its step splits into the host's work and the forward pass", _alone,
               "press n past r0's prefill; watch the Metrics panel's forward gauge"),
    Checkpoint("{{measured.batch}} requests decode in one step: compare host and forward with r0 alone", _batched,
               "run on (space) until the questions decode together"),
    Checkpoint("with async output processing, step() returns each step's event one step late", _one_step_late,
               "run with --async-output-processing and press n twice", variants=("async",)),
    every_request_finished(SCENARIO),
]

QUIZ = [
    QuizQuestion(
        "On a GPU a decode step's forward pass takes little time. What does the GPU do while the host schedules "
        "the next step, builds its tensors and turns the last tokens into text?",
        ("It computes the next step already",
         "It waits: without async output processing nothing is queued for it",
         "It prefetches the weights", "It runs the sampler"),
        1,
        "Without async output processing a step is host work, then the forward pass, then host work again. On "
        "this CPU the tiny model's forward pass took {{smollm2.tiny_sync_alone_forward_us:.0f}} us of a "
        "{{smollm2.tiny_sync_alone_step_us:.0f}} us step alone: busy {{smollm2.tiny_sync_alone_busy_pct:.0f}}%."),
    QuizQuestion(
        "What does async output processing overlap?",
        ("Two forward passes", "Step N's forward pass with step N-1's output processing (text, stop strings, "
         "deltas, the event)", "Step N's forward pass with step N+1's scheduling",
         "Prefill with decode"),
        1,
        "The forward pass runs in a model thread while the engine thread processes the previous step's outputs; "
        "step N+1 is scheduled only after step N's forward pass ends, since the scheduler needs N's tokens "
        "(vLLM v1's async scheduling schedules N+1 earlier, with placeholder tokens). So each event comes one "
        "step late ({{measured.async_empty_events}} events with nothing scheduled in this run), and the tokens "
        "are the same."),
    QuizQuestion(
        "SmolLM2's forward pass on this CPU is long beside the host's work. What is its forward share of a decode "
        "step alone, without async output processing?",
        ("Under a quarter", "About half", "Most of the step", "Nothing: the host computes it"),
        2,
        "SmolLM2 alone: forward {{smollm2.smollm2_sync_alone_forward_ms:.1f}} ms, host "
        "{{smollm2.smollm2_sync_alone_host_ms:.1f}} ms, busy {{smollm2.smollm2_sync_alone_busy_pct:.0f}}%. A GPU "
        "shrinks the forward pass, not the host's Python: there the share falls."),
    QuizQuestion(
        "What do CUDA graphs remove from a decode step?",
        ("The attention kernel", "The host launching hundreds of kernels one by one: a captured step is replayed "
         "with one launch", "The KV cache", "Sampling"),
        1,
        "They need a GPU (minipaged's are off until a GPU run shows them exact). Padded to a captured batch "
        "size, a decode step replays; prefills stay eager."),
]
