"""Async output processing on or off: the same greedy workload, run in turns by two engines, timed three ways.

Async output processing (vLLM v0's name for it; minipaged/engine_core.py) processes step N-1's outputs in
the engine thread while step N's forward pass runs in a model thread; scheduling still waits for the forward pass
(vLLM v1's async scheduling does not: lessons/lesson10_gpu_waits.md). It pays when the host's output work
(detokenization, stop strings, deltas, events) is a large share of a step *and* the forward pass lets go of
Python's GIL for long enough to hide it.
So each run records:

  * wall seconds for the whole workload (what a user waits; noisy on a shared machine),
  * the process's CPU seconds (both threads: what the overlap costs in total),
  * the engine thread's own CPU seconds (``time.thread_time``: the host's work that remains on it).

The two engines run in turns (off, on, off, on ...) so that a change in the machine's load hits both; the
medians are reported, and greedy tokens are checked identical.

    python bench/async_output_processing.py [--model smollm2 | --tiny] [--requests 32] [--max-tokens 64] [--rounds 5]
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from minipaged import Engine, SamplingParams
from minipaged.bench.report import machine_line, save
from minipaged.bench.report import markdown_table as table


def run_once(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    wall, cpu, thread = time.perf_counter(), time.process_time(), time.thread_time()
    outs = engine.generate(prompts, params, use_tqdm=False)
    return {"wall_s": time.perf_counter() - wall, "process_cpu_s": time.process_time() - cpu,
            "engine_thread_cpu_s": time.thread_time() - thread, "tokens": [o.token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tiny", action="store_true", help="a tiny random checkpoint: the host's work dominates")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--num-blocks", type=int, default=2048)
    args = ap.parse_args()
    model = args.model
    if args.tiny:
        from minipaged.model.testing import build_tiny_llama
        model = str(build_tiny_llama(tempfile.mkdtemp(prefix="async-bench-"), tie_word_embeddings=True))
    engines = {on: Engine(model, async_output_processing=on, num_blocks=args.num_blocks) for on in (False, True)}
    vocab = engines[False].model.embed.shape[0]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))] for _ in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for engine in engines.values():                                   # warm-up, not measured
        engine.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(args.rounds):
        for on in (False, True):
            runs[on].append(run_once(engines[on], prompts, params))
    assert all(r["tokens"] == runs[False][0]["tokens"] for rs in runs.values() for r in rs), \
        "async output processing changed greedy outputs"
    for rs in runs.values():
        for r in rs:
            r.pop("tokens")
    keys = ("wall_s", "process_cpu_s", "engine_thread_cpu_s")
    median = {on: {k: statistics.median(r[k] for r in runs[on]) for k in keys} for on in (False, True)}
    tokens = args.requests * args.max_tokens
    name = "tiny random checkpoint" if args.tiny else model
    md = (f"### Async output processing: {args.requests} requests x {args.max_tokens} tokens (greedy), {name}\n\n"
          f"{machine_line()}\n\nMedians of {args.rounds} runs each, taken in turns.\n\n"
          + table(["async output processing", "wall (s)", "output tok/s", "process CPU (s)",
                   "engine thread CPU (s)"],
                  [["on" if on else "off", m["wall_s"], tokens / m["wall_s"], m["process_cpu_s"],
                    m["engine_thread_cpu_s"]] for on, m in median.items()])
          + f"\n\nWall time off/on: **{median[False]['wall_s'] / median[True]['wall_s']:.2f}x**. "
          "Greedy outputs identical: yes.")
    save("async_output_processing" + ("_tiny" if args.tiny else ""), {
        "args": vars(args), "runs": {"off": runs[False], "on": runs[True]},
        "median": {"off": median[False], "on": median[True]},
        "wall_ratio_off_on": median[False]["wall_s"] / median[True]["wall_s"]}, md)


if __name__ == "__main__":
    main()
