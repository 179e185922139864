"""Preemption: an oversubscribed KV pool, recompute vs swap, in one run.

More requests run than the pool can hold at full length, so the scheduler must preempt. Recompute throws a
victim's KV away and recomputes it later (extra prefill tokens); swap copies its blocks to a CPU pool and
back (blocks copied). Outputs must not change.

    python bench/preemption.py [--model smollm2] [--num-blocks 48]
"""
from __future__ import annotations

import argparse
import random
import time

from minipaged.bench.report import machine_line, save
from minipaged.bench.report import markdown_table as table
from minipaged import Engine, SamplingParams


def run(model: str, args, **options) -> dict:
    engine = Engine(model, block_size=16, max_num_seqs=args.requests, **options)
    vocab = engine.model.embed.shape[0]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(60, 160))] for _ in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)          # warm-up
    start = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    s = engine.stats()
    assert s["blocks_free"] == s["blocks_total"] and s["cpu_blocks_free"] == s["cpu_blocks_total"]
    tokens = sum(len(o.token_ids) for o in outs)
    return {"mode": options.get("preemption_mode", "none (big pool)"),
            "throughput_tok_s": tokens / wall, "wall_s": wall,
            "preemptions": int(s["preemptions_recompute"] + s["preemptions_swap"]),
            "swap_preemptions": int(s["preemptions_swap"]),
            "extra_prefill_tokens": int(s["prompt_tokens_computed"] - 3 - sum(len(p) for p in prompts)),
            "blocks_copied": int(s["blocks_swapped_out"] + s["blocks_swapped_in"]),
            "steps": int(s["steps"]), "outputs": [o.token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--num-blocks", type=int, default=64, help="GPU pool; full need is about 16 x 14 blocks")
    args = ap.parse_args()
    results = [run(args.model, args, num_blocks=1024, enable_prefix_caching=False),
               run(args.model, args, num_blocks=args.num_blocks, preemption_mode="recompute",
                   enable_prefix_caching=False),
               run(args.model, args, num_blocks=args.num_blocks, preemption_mode="swap", num_cpu_blocks=512,
                   enable_prefix_caching=False)]
    reference = results[0].pop("outputs")
    for r in results[1:]:
        assert r.pop("outputs") == reference, f"{r['mode']} changed greedy outputs"
    md = (f"### Preemption: {args.requests} requests (prompts 60-160 tokens, {args.max_tokens} output tokens) on a "
          f"{args.num_blocks}-block pool, {args.model}\n\n{machine_line()}\n\n"
          + table(["mode", "throughput (tok/s)", "preemptions", "extra prefill tokens", "blocks copied", "steps"],
                  [[r["mode"], r["throughput_tok_s"], r["preemptions"], r["extra_prefill_tokens"],
                    r["blocks_copied"], r["steps"]] for r in results])
          + f"\n\nThroughput ratio swap / recompute: **{results[2]['throughput_tok_s'] / results[1]['throughput_tok_s']:.2f}x**."
          " Greedy outputs identical in all three: yes.")
    save("preemption", {"args": vars(args), "results": results}, md)


if __name__ == "__main__":
    main()
