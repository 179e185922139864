"""Chunked prefill: how the token budget trades decode smoothness (ITL) against long-prompt TTFT.

Workload: a stream of short requests that are decoding, and a few long prompts (2000 tokens) that arrive
mid-run. For budgets 256, 512, 2048, 8192 with chunked prefill, and with chunked prefill off (prefill-first),
it reports the decoders' mean and p99 inter-token latency, the long prompts' mean TTFT and the throughput,
as a table and a PNG plot (bench/out/chunked_prefill.png).

vLLM's guide says: smaller max_num_batched_tokens gives better ITL (fewer prefill tokens interrupt each
decode step); larger gives better TTFT (the long prompt gets through in fewer steps).

    python bench/chunked_prefill.py [--model smollm2] [--long-tokens 2000]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from minipaged.bench.report import BENCH_OUT as OUT
from minipaged.bench.report import machine_line, percentile, save
from minipaged.bench.report import markdown_table as table
from minipaged.bench.run import drive
from minipaged import Engine, SamplingParams


def workload(vocab: int, long_tokens: int, num_decoders: int, num_long: int, seed: int = 0):
    rng = random.Random(seed)
    arrivals = []
    for i in range(num_decoders):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(20, 60))]
        arrivals.append((i, prompt, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)))
    for j in range(num_long):
        prompt = [rng.randrange(3, vocab) for _ in range(long_tokens)]
        arrivals.append((num_decoders + 4 + 6 * j, prompt, SamplingParams(temperature=0, max_tokens=8,
                                                                          ignore_eos=True)))
    return arrivals


def run(model: str, budget, args) -> dict:
    chunked = budget is not None
    # (long_prefill_token_threshold 0: the budget alone sets a long prompt's chunk, the thing this sweep varies;
    # the CPU default of 128 would cap every chunk below the larger budgets. bench/long_prefill.py sweeps the cap.)
    options = dict(enable_chunked_prefill=chunked, enable_prefix_caching=False, max_num_seqs=64,
                   long_prefill_token_threshold=0)
    if chunked:
        options["max_num_batched_tokens"] = budget
    engine = Engine(model, **options)
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)        # warm-up
    arrivals = workload(engine.model.embed.shape[0], args.long_tokens, args.decoders, args.long)
    start = time.perf_counter()
    outs, events, ttft_steps = drive(engine, arrivals)
    wall = time.perf_counter() - start
    decoders = [o for o in outs.values() if len(o.prompt_token_ids) < args.long_tokens]
    longs = [o for o in outs.values() if len(o.prompt_token_ids) >= args.long_tokens]
    itls = [gap for o in decoders for gap in o.outputs[0].itls]
    tokens = sum(len(o.token_ids) for o in outs.values())
    return {"budget": budget if chunked else "chunked off",
            "itl_mean_ms": 1000 * statistics.mean(itls), "itl_p99_ms": 1000 * percentile(itls, 99),
            "itl_max_ms": 1000 * max(itls), "ttft_long_s": statistics.mean(o.metrics.ttft for o in longs),
            "ttft_long_steps": statistics.mean(ttft_steps[o.request_id] for o in longs),
            "throughput_tok_s": tokens / wall, "steps": len(events),
            "outputs": [o.token_ids for o in outs.values()]}


def plot(results: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [str(r["budget"]) for r in results]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 4))
    ax1.bar(labels, [r["itl_p99_ms"] for r in results], color="#4c72b0", label="p99")
    ax1.bar(labels, [r["itl_mean_ms"] for r in results], color="#8fb0e0", label="mean")
    ax1.set_title("Decoders' inter-token latency (ms)")
    ax1.set_xlabel("max_num_batched_tokens")
    ax1.legend()
    ax2.bar(labels, [r["ttft_long_s"] for r in results], color="#dd8452")
    ax2.set_title("Long prompts' mean TTFT (s)")
    ax2.set_xlabel("max_num_batched_tokens")
    ax3.bar(labels, [r["ttft_long_steps"] for r in results], color="#c44e52")
    ax3.set_title("Long prompts' mean TTFT (engine steps)")
    ax3.set_xlabel("max_num_batched_tokens")
    fig.suptitle("Token budget vs decode smoothness and long-prompt TTFT (wall time and steps)")
    fig.tight_layout()
    OUT.mkdir(exist_ok=True)
    fig.savefig(OUT / "chunked_prefill.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--long-tokens", type=int, default=2000)
    ap.add_argument("--decoders", type=int, default=8)
    ap.add_argument("--long", type=int, default=2)
    ap.add_argument("--budgets", default="256,512,2048,8192")
    args = ap.parse_args()
    results = [run(args.model, int(b), args) for b in args.budgets.split(",")]
    results.append(run(args.model, None, args))
    reference = results[0].pop("outputs")
    for r in results[1:]:
        assert r.pop("outputs") == reference, f"budget {r['budget']} changed greedy outputs"
    plot(results)
    md = (f"### Chunked prefill: {args.decoders} decoding requests, {args.long} prompts of {args.long_tokens} tokens "
          f"arriving mid-run, {args.model}\n\n{machine_line()}\n\n"
          + table(["max_num_batched_tokens", "ITL mean (ms)", "ITL p99 (ms)", "ITL max (ms)", "long TTFT (s)",
                   "long TTFT (steps)", "throughput (tok/s)", "steps"],
                  [[r["budget"], r["itl_mean_ms"], r["itl_p99_ms"], r["itl_max_ms"], r["ttft_long_s"],
                    r["ttft_long_steps"], r["throughput_tok_s"], r["steps"]] for r in results])
          + "\n\nGreedy outputs identical across all rows: yes. Plot: bench/out/chunked_prefill.png")
    save("chunked_prefill", {"args": vars(args), "results": results}, md)


if __name__ == "__main__":
    main()
