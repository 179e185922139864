"""Tensor and pipeline parallelism on this CPU: what each layout costs in communication, and the KV
capacity per rank it buys.

For each layout (tp=1, tp=2, tp=3, pp=2) the same greedy workload runs on a random Llama shaped so that every
tp divides it (12 heads, 6 KV heads); it reports the mean step time, rank 0's communication time per step
(sending, receiving and waiting for other ranks: ``communication_seconds`` in the engine's counters) and its
share of the step, and the KV blocks per rank that a fixed per-rank budget holds. Outputs are checked equal
to tp=1's.

A 2-core machine cannot show a speed-up: 3 ranks on 2 cores take turns, so the step time here says what
communication and oversubscription cost, not what parallelism gains on real devices.

    python bench/parallel.py [--model PATH] [--layouts 1x1,2x1,3x1,1x2]
"""
from __future__ import annotations

import argparse
import tempfile
import time

from minipaged.bench.report import machine_line, save
from minipaged.bench.report import markdown_table as table
from minipaged.bench.requests import random_token_prompts
from minipaged import Engine, SamplingParams
from minipaged.model.testing import build_tiny_llama

BUDGET_GIB = 0.01          # KV memory per rank: the pool in blocks is what this holds


def run(model: str, tp: int, pp: int, prompts, params) -> dict:
    with Engine(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, kv_cache_memory=BUDGET_GIB,
                num_threads=1, block_size=16) as engine:
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)     # warm-up
        before = engine.stats()
        start = time.perf_counter()
        outs = engine.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        after = engine.stats()
        steps = after["steps"] - before["steps"]
        comm = after["communication_seconds"] - before["communication_seconds"]
        step_s = (after["step_seconds"] - before["step_seconds"]) / steps
        return {"layout": f"tp={tp} pp={pp}", "ranks": tp * pp, "kv_blocks_per_rank": engine.info.num_blocks,
                "step_ms": 1000 * step_s, "comm_ms_per_step": 1000 * comm / steps,
                "comm_share": comm / (step_s * steps), "tok_s": sum(len(o.token_ids) for o in outs) / wall,
                "outputs": [o.token_ids for o in outs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Llama whose heads divide by every tp (default: a random "
                                                       "4-layer Llama, hidden 384, 12 heads, 6 KV heads)")
    parser.add_argument("--layouts", default="1x1,2x1,3x1,1x2", help="tp x pp, comma-separated")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    model = args.model or str(build_tiny_llama(tempfile.mkdtemp(prefix="bench-parallel-"), hidden_size=384,
                                               num_layers=4, num_heads=12, num_kv_heads=6, intermediate_size=1536))
    prompts = random_token_prompts(args.requests, 20, 120, seed=0, vocab=256)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    results = []
    for layout in args.layouts.split(","):
        tp, pp = (int(x) for x in layout.split("x"))
        results.append(run(model, tp, pp, prompts, params))
        print(results[-1]["layout"], "done", flush=True)
    first = results[0]["outputs"]
    for r in results:
        r["same_outputs_as_first"] = r.pop("outputs") == first
    headers = ["layout", "ranks", "KV blocks per rank", "step ms", "comm ms/step", "comm share", "tok/s",
               "same tokens"]
    rows = [[r["layout"], r["ranks"], r["kv_blocks_per_rank"], r["step_ms"], r["comm_ms_per_step"],
             f"{100 * r['comm_share']:.0f}%", r["tok_s"], r["same_outputs_as_first"]] for r in results]
    markdown = (f"{machine_line()}; 1 thread per rank; {args.requests} requests, prompts 20-120 tokens, "
                f"{args.max_tokens} new tokens; KV budget {BUDGET_GIB} GiB per rank\n\n" + table(headers, rows))
    save("parallel", {"machine": machine_line(), "args": vars(args), "results": results}, markdown)


if __name__ == "__main__":
    main()
