"""A student's 16-token request while another asks n=10 samples of a 7,000-token prompt (issue 39's capacity note).

One engine per setting of ``long_prefill_token_threshold`` (0 is the old behaviour: a long prompt takes the whole
token budget each step, and everything that arrives later waits behind its prefill). The long request arrives
first; after its first step a short request arrives. For each setting it records the short request's time to
first token, its longest pause between two tokens and its completion, the long request's time until all ten
samples have their first token, and the engine's total, and checks that the greedy tokens are the same.

Time is measured as CPU time of the engine's thread with torch on one thread (``--threads 1``): the machine
is shared, so wall-clock time says more about the neighbours than about the scheduler. Wall time is recorded
beside it, with the load average, for reference.

    python bench/long_prefill.py [--model smollm2] [--thresholds 0,512,256,128] [--prompt-tokens 7000] [--n 10]
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Any

from minipaged import Engine, SamplingParams
from minipaged.bench.report import markdown_table, save

VICTIM_PROMPT = "Say hello to the class in one short sentence."


def long_prompt(engine: Engine, num_tokens: int) -> list[int]:
    words = " ".join(f"word{i}" for i in range(num_tokens))
    ids = list(engine.tokenizer(words).input_ids)[:num_tokens]
    assert len(ids) == num_tokens, "the text gave too few tokens"
    return ids


def run(model: str, threshold: int, args: argparse.Namespace) -> dict[str, Any]:
    engine = Engine(model, long_prefill_token_threshold=threshold, num_threads=args.threads)
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)          # warm-up
    greedy = dict(temperature=0.0, ignore_eos=True)
    long_id = engine.add_request(long_prompt(engine, args.prompt_tokens),
                                 SamplingParams(n=args.n, max_tokens=args.long_max_tokens, **greedy))
    cpu = wall = 0.0

    def step():
        nonlocal cpu, wall
        c, w = time.thread_time(), time.perf_counter()
        result = engine.step()
        cpu, wall = cpu + time.thread_time() - c, wall + time.perf_counter() - w
        return result

    step()                                              # the long request is under way when the short one comes
    arrived_cpu, arrived_wall = cpu, wall
    victim_id = engine.add_request(VICTIM_PROMPT, SamplingParams(max_tokens=args.victim_max_tokens, **greedy))
    victim_times: list[tuple[float, float]] = []         # (cpu, wall) at each of its tokens
    long_first: dict[int, float] = {}                    # sample index -> cpu at its first token
    outputs: dict[str, Any] = {}
    steps = 1
    while engine.has_unfinished_requests():
        result = step()
        steps += 1
        for delta in result.outputs:
            for sample in delta.samples:
                if not sample.token_ids:
                    continue
                if delta.request_id == victim_id:
                    victim_times.extend([(cpu - arrived_cpu, wall - arrived_wall)] * len(sample.token_ids))
                elif delta.request_id == long_id:
                    long_first.setdefault(sample.index, cpu)
            if delta.output is not None:
                outputs[delta.request_id] = delta.output
    gaps = [b[0] - a[0] for a, b in zip(victim_times, victim_times[1:])]
    wall_gaps = [b[1] - a[1] for a, b in zip(victim_times, victim_times[1:])]
    free = engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.close()
    return {"long_prefill_token_threshold": threshold,
            "victim_ttft_cpu_s": victim_times[0][0], "victim_max_gap_cpu_s": max(gaps),
            "victim_done_cpu_s": victim_times[-1][0], "victim_ttft_wall_s": victim_times[0][1],
            "victim_max_gap_wall_s": max(wall_gaps), "victim_done_wall_s": victim_times[-1][1],
            "long_all_first_tokens_cpu_s": max(long_first.values()), "total_cpu_s": cpu, "total_wall_s": wall,
            "steps": steps, "all_blocks_free": free,
            "tokens": {"victim": outputs[victim_id].token_ids,
                       "long": [list(s.token_ids) for s in outputs[long_id].outputs]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--thresholds", default="0,512,256,128")
    ap.add_argument("--prompt-tokens", type=int, default=7000)
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--long-max-tokens", type=int, default=4)
    ap.add_argument("--victim-max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    results = [run(args.model, int(t), args) for t in args.thresholds.split(",")]
    reference = results[0]["tokens"]
    for r in results:
        r["same_tokens"] = r.pop("tokens") == reference
        assert r["same_tokens"], f"threshold {r['long_prefill_token_threshold']} changed greedy outputs"
    load = {"before": load_before, "after": os.getloadavg()[0]}
    md = (f"### A {args.victim_max_tokens}-token request during a {args.prompt_tokens:,}-token n={args.n} prompt, "
          f"{args.model}, torch on {args.threads} thread(s); seconds of the engine thread's CPU time (wall in "
          f"brackets; load average {load['before']:.1f} before, {load['after']:.1f} after)\n\n"
          + markdown_table(["long_prefill_token_threshold", "short: first token", "short: longest pause",
                            "short: done", f"long: all {args.n} first tokens", "engine total", "steps", "same tokens"],
                           [[("0 (off: before)" if r["long_prefill_token_threshold"] == 0
                              else r["long_prefill_token_threshold"]),
                             f"{r['victim_ttft_cpu_s']:.2f} ({r['victim_ttft_wall_s']:.2f})",
                             f"{r['victim_max_gap_cpu_s']:.2f} ({r['victim_max_gap_wall_s']:.2f})",
                             f"{r['victim_done_cpu_s']:.2f} ({r['victim_done_wall_s']:.2f})",
                             f"{r['long_all_first_tokens_cpu_s']:.1f}", f"{r['total_cpu_s']:.1f}", r["steps"],
                             "yes" if r["same_tokens"] else "**no**"] for r in results]))
    save("long_prefill", {"args": vars(args), "load_average": load, "results": results}, md)


if __name__ == "__main__":
    main()
