"""Lesson 12: why vLLM runs its engine in its own process. The same 128 streams three ways on the lessons' tiny
model (a fast device's regime: the forward pass is cheap, the host's Python is not): the engine in-process,
``minipaged serve --core-in-thread`` (one process, one GIL for the engine and the HTTP server) and
``minipaged serve`` (the engine core in a process of its own). Served runs are real servers and real streaming
clients (``lessons/serving.py``)."""
from __future__ import annotations

import os
from typing import Any

from minipaged.events import StepEvent

from .core import Checkpoint, QuizQuestion, Text, Trace, decodes, every_request_finished, request
from .serving import ServedRun, ServedScenario
from .texts import QUESTIONS

NUMBER = 12
TITLE = "Why vLLM runs its engine in its own process"
SUMMARY = ("128 streams in-process, through a one-process server and a two-process one: tokens/s, CPU per token "
           "by process, the host's share of a step")

NUM_STREAMS = 128
MAX_TOKENS = 32
IN_PROCESS, ONE, TWO = "in-process", "one-process", "two-processes"
BUSY = 16                      # a decode step of at least this many streams: the batch at work

SCENARIO = ServedScenario(
    # Room for every stream at once (128 x 3 blocks of 16), every prompt prefilled in one step; prefix caching
    # off, so every variant computes the same tokens however its requests arrive. One thread per process, as
    # bench/serve.py measures (the machine has two cores for the server, its core and the clients).
    options=dict(block_size=16, num_blocks=512, max_model_len=256, max_num_seqs=NUM_STREAMS,
                 max_num_batched_tokens=4096, enable_prefix_caching=False, num_threads=1),
    requests=tuple(request(f"r{i}", 1, Text(QUESTIONS[i % len(QUESTIONS)], 16 + (7 * i) % 17), max_tokens=MAX_TOKENS)
                   for i in range(NUM_STREAMS)),
    variants={IN_PROCESS: {}, ONE: {}, TWO: {}},
    served={ONE: ("--core-in-thread",), TWO: ()},
)
KEYS = {IN_PROCESS: "in_process", ONE: "one_process", TWO: "two_processes"}


def measure(runs: dict[str, ServedRun]) -> dict[str, Any]:
    """What does not depend on the machine or on timing: the workload, the in-process run's schedule, and
    whether every served stream got exactly the in-process greedy tokens (times: measure_smollm2)."""
    local = runs[IN_PROCESS]
    lengths = [spec.prompt_len for spec in SCENARIO.requests]
    out: dict[str, Any] = dict(
        num_streams=NUM_STREAMS, max_tokens=MAX_TOKENS, prompt_min=min(lengths), prompt_max=max(lengths),
        total_tokens=NUM_STREAMS * MAX_TOKENS, in_process_tokens=local.generated_tokens,
        in_process_steps=local.num_steps, in_process_full_steps=sum(1 for ev in local.events
                                                                    if decodes(ev) == NUM_STREAMS),
    )
    for name in (ONE, TWO):
        if name in runs:
            out[f"{KEYS[name]}_same_tokens"] = runs[name].outputs_by_request() == local.outputs_by_request()
    return out


def timings(runs: dict[str, ServedRun]) -> dict[str, float]:
    """Tokens/s, CPU microseconds per token by process, and from the engine's own events: its steps, the host's
    and the forward pass's time per token (summed over the run's steps), the host's share of the steps' time,
    and the share of the wall time the engine spent in steps at all, for every variant."""
    base = runs[IN_PROCESS]
    base_cpu = base.cpu_s["engine"] / base.generated_tokens
    out: dict[str, float] = {"cores": float(os.cpu_count() or 0)}
    for name, run in runs.items():
        key, tokens = KEYS[name], run.generated_tokens
        server_cpu = sum(v for k, v in run.cpu_s.items() if k != "clients")
        timed = [ev for ev in run.events if ev.host_s is not None and ev.forward_s is not None]
        host, forward = sum(ev.host_s for ev in timed), sum(ev.forward_s for ev in timed)
        out.update({
            f"{key}_tok_s": run.tokens_per_s, f"{key}_pct": 100 * run.tokens_per_s / base.tokens_per_s,
            f"{key}_ttft_ms": 1e3 * run.mean_ttft_s,
            f"{key}_cpu_us": 1e6 * server_cpu / tokens, f"{key}_cpu_pct": 100 * server_cpu / tokens / base_cpu,
            f"{key}_steps": float(run.num_steps), f"{key}_batch": tokens / run.num_steps,
            f"{key}_host_us": 1e6 * host / tokens, f"{key}_forward_us": 1e6 * forward / tokens,
            f"{key}_host_pct": 100 * host / (host + forward),
            f"{key}_stepping_pct": 100 * sum(ev.duration_s for ev in run.events) / run.wall_s,
        })
        if name != IN_PROCESS:
            out.update({f"{key}_api_cpu_us": 1e6 * run.cpu_s["api_server"] / tokens,
                        f"{key}_clients_cpu_us": 1e6 * run.cpu_s["clients"] / tokens})
            if name == TWO:
                out[f"{key}_core_cpu_us"] = 1e6 * run.cpu_s["core"] / tokens
    return out


def measure_smollm2(runs: dict[str, ServedRun]) -> dict[str, float]:
    """The machine's numbers (``python -m minipaged.lessons 12 --measure-smollm2``). The lesson is about the
    tiny model, a cheap forward pass: the regime of a fast GPU; TIMED_ON has them measured on it."""
    return timings(runs)


TIMED_ON = "tiny"          # python -m minipaged.lessons 12 --measure-smollm2 runs the scenario on the tiny model


# ------------------------------------------------------------------------------------ checkpoints

def _split(ev: StepEvent) -> str:
    host = 100 * ev.host_s / ev.duration_s if ev.duration_s else 0.0
    return (f"{1e3 * ev.duration_s:.2f} ms: forward {1e3 * ev.forward_s:.2f} ms, host {1e3 * ev.host_s:.2f} ms "
            f"(host {host:.0f}%)")


def _busy_step(t: Trace) -> Any:
    ev = t.last
    if decodes(ev) < BUSY or ev.host_s is None or ev.forward_s is None:
        return None
    return f"step {ev.step}: {decodes(ev)} streams decode, {_split(ev)}"


def _all_together(t: Trace) -> Any:
    ev = t.last
    return decodes(ev) == NUM_STREAMS and ev.host_s is not None and \
        f"step {ev.step}: all {NUM_STREAMS} streams in one decode step, {_split(ev)}"


def _arrived_apart(t: Trace) -> Any:
    steps = [ev.step for ev in t.events if ev.arrivals]
    if len(steps) < 2:
        return None
    return (f"the streams arrived in {len(steps)} steps ({len(t.last.arrivals) if t.last.arrivals else 0} in step "
            f"{t.last.step}): each HTTP request is read, checked and handed to the engine one by one")


CHECKPOINTS = [
    Checkpoint("a decode step of many streams splits into the host's work and the forward pass", _busy_step,
               "press n past the prefill; the Metrics panel's forward gauge shows the same split"),
    Checkpoint("all {{measured.num_streams}} streams decode in one step", _all_together,
               "press n once more after the prefill", variants=(IN_PROCESS,)),
    Checkpoint("behind a server, the streams arrive over several steps", _arrived_apart,
               "serve the scenario and send it (the command below), with `minipaged watch --attach` open",
               variants=(ONE, TWO)),
    every_request_finished(SCENARIO),
]

QUIZ = [
    QuizQuestion(
        "With the engine in a thread of the HTTP server's process (`minipaged serve --core-in-thread`), what do the engine's "
        "scheduler and each streamed token's chunk have in common?",
        ("Nothing: they run in different threads, so in parallel", "They share one interpreter: Python runs one "
         "thread at a time (the GIL), so every chunk, write and task switch waits for the engine's Python and "
         "the engine for theirs", "They share the KV cache", "They share the tokenizer's lock"),
        1,
        "On this machine the one-process server delivered {{smollm2.one_process_pct:.0f}}% of the in-process "
        "tokens per second, its steps ran {{smollm2.one_process_stepping_pct:.0f}}% of the wall time (in-process: "
        "{{smollm2.in_process_stepping_pct:.0f}}%)."),
    QuizQuestion(
        "What does the second process cost?",
        ("Nothing", "Encoding every step's outputs and event, a second copy of the tokenizer, and the messages "
         "between the processes (IPC): more CPU per token in all", "A second copy of the model's weights",
         "A second KV cache"),
        1,
        "The two processes spent {{smollm2.two_processes_cpu_us:.1f}} us of CPU per token (core "
        "{{smollm2.two_processes_core_cpu_us:.1f}}, API server {{smollm2.two_processes_api_cpu_us:.1f}}), "
        "the engine in-process {{smollm2.in_process_cpu_us:.1f}} us: {{smollm2.two_processes_cpu_pct:.0f}}%."),
    QuizQuestion(
        "On this {{smollm2.cores:.0f}}-core machine, why can the two-process server fall behind the in-process "
        "engine even though no GIL is shared?",
        ("ZeroMQ is slow", "Three busy processes (the core, the API server, the clients) share two cores: one "
         "always waits for a core, and the core's steps wait with it", "The core process runs at a lower "
         "priority", "The tiny model is different in each process"),
        1,
        "Two processes: {{smollm2.two_processes_pct:.0f}}% of the in-process tokens per second; the clients "
        "alone spent {{smollm2.two_processes_clients_cpu_us:.1f}} us of CPU per token. vLLM's measurement "
        "(within 3% of offline `LLM`) ran its clients and server on a machine with CPU cores to spare."),
    QuizQuestion(
        "vLLM tried a third process, for detokenization. What did it find?",
        ("Faster, so vLLM v1 has three", "Slower (\"Adding a 3rd process hurts performance\"), so it kept two",
         "The same", "It was never tried"),
        1,
        "vLLM PR #11636, closed unmerged: the extra hop costs more than the text it moves off the API server."),
]
