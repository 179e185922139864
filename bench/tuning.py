"""The seed guide's tuning walkthrough, reproduced: ``minipaged serve`` + ``minipaged bench serve``, one knob at a time.

    python bench/tuning.py                    # every step on SmolLM2 (~10 min on a quiet 2-core machine)
    python bench/tuning.py --only prefix spec # some steps; the others keep their numbers in docs/tuning.json
    python bench/tuning.py --model DIR --quick  # a tiny checkpoint and small workloads: checks the plumbing

Each configuration gets a fresh ``minipaged serve`` on 127.0.0.1 (one at a time, so they never share the
CPU), one warm-up request, then ``minipaged bench serve`` with the step's workload; the server's /metrics
is read before and after, for what the client cannot see (preemptions, prefix-cache hits, accepted drafts).
Steps, as the guide orders them:

1. baseline: the default server under a request-rate sweep;
2./3. memory and concurrency: ``--max-num-seqs`` in a KV pool too small for everyone (and a big pool);
4. ``--max-num-batched-tokens`` (chunked prefill's budget) under long prompts arriving mid-run;
   prefix caching on and off with a long shared system prompt;
   speculative decoding (n-gram, ``--speculative-config``) on prompts that quote their input;
then the peer comparison (``minipaged.bench.peer``, also ``bench/peer.py`` alone): ``minipaged serve`` vs
``transformers serve``.

Everything measured goes to docs/tuning.json (``values`` fill the docs; ``runs`` keep each run's summary),
the pictures to docs/tuning-*.png, and docs/tuning.md and docs/performance.md (its peer section) are
rendered from their templates (``minipaged.bench.docs``). The machinery: ``minipaged.bench.walkthrough``.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

from minipaged.bench import peer
from minipaged.bench.walkthrough import (Context, bars, change, command_line, main, rate_words, run_config, summary,
                                         table, write_prompts)
from minipaged.workloads import INSTRUCTIONS, PASSAGES, QUESTIONS, SENTENCES, SYSTEM_PROMPT


# ---------------------------------------------------------------------------------------------------- the steps

def step_baseline(ctx: Context) -> dict[str, Any]:
    """Guide step 1: the default server, a request-rate sweep of random prompts."""
    from minipaged.bench.serve import plot_sweeps
    rates = ["0.5", "1", "2"] if not ctx.quick else ["4", "inf"]
    args = ["--dataset", "random", "--input-len", "64:256", "--output-len", str(ctx.scale(32, 8)),
            "--num-prompts", str(ctx.scale(10, 4)), "--vocab-size", str(ctx.vocab_size), "--request-rate", *rates]
    record = run_config(ctx, "baseline", "default", [], args)
    ctx.runs["baseline"] = [{k: v for k, v in r.items() if k != "requests"} for r in record["sweep"]]
    plot_sweeps({"minipaged serve (defaults)": record}, str(ctx.out / "tuning-baseline.png"),
                "Step 1, baseline: minipaged serve defaults, SmolLM2, request-rate sweep")
    sweep = record["sweep"]
    values = {"baseline_cmd": command_line(args), "baseline_num_prompts": int(args[args.index("--num-prompts") + 1])}
    for end, r in (("first", sweep[0]), ("last", sweep[-1])):
        values.update({f"baseline_{end}_rate": rate_words(r["request_rate"]),
                       f"baseline_{end}_tps": r["output_throughput"], f"baseline_{end}_ttft": r["ttft"]["median_ms"],
                       f"baseline_{end}_tpot": r["tpot"]["median_ms"]})
    values["baseline_tps_change"] = change(sweep[-1]["output_throughput"], sweep[0]["output_throughput"])
    values["baseline_ttft_change"] = change(sweep[-1]["ttft"]["median_ms"], sweep[0]["ttft"]["median_ms"])
    values["baseline_tpot_change"] = change(sweep[-1]["tpot"]["median_ms"], sweep[0]["tpot"]["median_ms"])
    rows = [[rate_words(r["request_rate"]), r["request_throughput"], r["output_throughput"], r["ttft"]["median_ms"],
             r["ttft"]["p99_ms"], r["tpot"]["median_ms"], r["tpot"]["p99_ms"]] for r in sweep]
    values["baseline_table"] = table(["request rate", "requests/s done", "output tok/s", "TTFT median ms",
                                      "TTFT p99 ms", "TPOT median ms", "TPOT p99 ms"], rows)
    return values


def step_concurrency(ctx: Context) -> dict[str, Any]:
    """Guide steps 2 and 3: --max-num-seqs in a KV pool that holds about three requests, and in a big pool."""
    input_len, output_len = ctx.scale(96, 24), ctx.scale(40, 16)
    block = 16
    per_request = -(-(input_len + output_len) // block)          # blocks one finished request holds
    small_pool = 3 * per_request
    args = ["--dataset", "random", "--input-len", str(input_len), "--output-len", str(output_len),
            "--num-prompts", str(ctx.scale(8, 6)), "--vocab-size", str(ctx.vocab_size), "--request-rate", "inf"]
    configs = [(f"seqs 1, pool {small_pool}", ["--max-num-seqs", "1", "--num-blocks", str(small_pool)]),
               (f"seqs 3, pool {small_pool}", ["--max-num-seqs", "3", "--num-blocks", str(small_pool)]),
               (f"seqs 16, pool {small_pool}", ["--max-num-seqs", "16", "--num-blocks", str(small_pool)]),
               ("seqs 16, default pool", ["--max-num-seqs", "16"])]
    results = {label: summary(run_config(ctx, "concurrency", label, flags, args)) for label, flags in configs}
    ctx.runs["concurrency"] = results
    labels = list(results)
    bars(ctx.out / "tuning-concurrency.png", "Steps 2-3: --max-num-seqs and the KV pool", labels,
         [("output tokens/s", [r["output_tps"] for r in results.values()]),
          ("median TPOT ms", [r["tpot_med"] for r in results.values()]),
          ("preemptions", [r["preemptions"] for r in results.values()])])
    s1, s3, s16, big = (results[label] for label in labels)
    return {
        "conc_cmd": command_line(args), "conc_pool_blocks": small_pool, "conc_pool_tokens": small_pool * block,
        "conc_request_blocks": per_request, "conc_input_len": input_len, "conc_output_len": output_len,
        "conc_table": table(["server flags", "output tok/s", "TTFT median ms", "TPOT median ms", "preemptions",
                             "prefill tokens computed"],
                            [[f"`{' '.join(flags)}`", r["output_tps"], r["ttft_med"], r["tpot_med"],
                              int(r["preemptions"]), int(r["prefill_tokens_computed"])]
                             for (label, flags), r in zip(configs, results.values())]),
        "conc_s3_vs_s1_tps": change(s3["output_tps"], s1["output_tps"]),
        "conc_s3_vs_s1_tpot": change(s3["tpot_med"], s1["tpot_med"]),
        "conc_s16_preemptions": int(s16["preemptions"]), "conc_s3_preemptions": int(s3["preemptions"]),
        "conc_s16_vs_s3_tps": change(s16["output_tps"], s3["output_tps"]),
        "conc_s16_extra_prefill": int(s16["prefill_tokens_computed"] - s3["prefill_tokens_computed"]),
        "conc_big_vs_s3_tps": change(big["output_tps"], s3["output_tps"]),
        "conc_big_vs_s3_tpot": change(big["tpot_med"], s3["tpot_med"]),
    }


def step_budget(ctx: Context) -> dict[str, Any]:
    """Guide step 4 (chunked prefill): --max-num-batched-tokens while long prompts keep arriving."""
    budgets = ["64", "256", "2048"]
    args = ["--dataset", "random", "--input-len", str(ctx.scale(768, 200)), "--output-len", str(ctx.scale(24, 8)),
            "--num-prompts", str(ctx.scale(6, 4)), "--vocab-size", str(ctx.vocab_size),
            "--request-rate", "1" if not ctx.quick else "8"]
    # (no cap on a long prompt's chunk: the budget alone sets it, the thing this step varies; the CPU default
    # --long-prefill-token-threshold 128 would cap every chunk below the two larger budgets)
    results = {b: summary(run_config(ctx, "budget", f"budget {b}", ["--max-num-batched-tokens", b,
                                                                    "--long-prefill-token-threshold", "0"], args))
               for b in budgets}
    ctx.runs["budget"] = results
    labels = [f"budget {b}" for b in budgets]
    bars(ctx.out / "tuning-budget.png", "Step 4: --max-num-batched-tokens, long prompts arriving", labels,
         [("median TTFT ms", [r["ttft_med"] for r in results.values()]),
          ("p99 ITL ms (token gaps)", [r["itl_p99"] for r in results.values()]),
          ("output tokens/s", [r["output_tps"] for r in results.values()])])
    small, mid, big = (results[b] for b in budgets)
    return {
        "budget_cmd": command_line(args), "budget_input_len": int(args[args.index("--input-len") + 1]),
        "budget_table": table(["--max-num-batched-tokens", "TTFT median ms", "TTFT p99 ms", "ITL median ms",
                               "ITL p99 ms", "output tok/s"],
                              [[b, r["ttft_med"], r["ttft_p99"], r["itl_med"], r["itl_p99"], r["output_tps"]]
                               for b, r in results.items()]),
        "budget_itl_p99_small_vs_big": change(small["itl_p99"], big["itl_p99"]),
        "budget_ttft_big_vs_small": change(big["ttft_med"], small["ttft_med"]),
        "budget_ttft_big_vs_mid": change(big["ttft_med"], mid["ttft_med"]),
        "budget_itl_p99_mid_vs_big": change(mid["itl_p99"], big["itl_p99"]),
    }


def long_system_prompt(words: int) -> str:
    """SYSTEM_PROMPT followed by report sentences until about ``words`` words: a long shared prefix."""
    text = SYSTEM_PROMPT + " Background for every answer:"
    i = 0
    while len(text.split()) < words:
        text += " " + SENTENCES[i % len(SENTENCES)]
        i += 1
    return text


def step_prefix(ctx: Context) -> dict[str, Any]:
    """Guide step 4 (prefix caching): one long system prompt shared by every request, caching on and off."""
    system = long_system_prompt(ctx.scale(380, 60))
    n = ctx.scale(10, 4)
    prompts = write_prompts(ctx, "shared-prefix", [f"{system}\n\nQuestion: {q}\nAnswer:" for q in QUESTIONS[:n]])
    args = ["--dataset", prompts, "--output-len", str(ctx.scale(16, 6)), "--num-prompts", str(n),
            "--request-rate", "1" if not ctx.quick else "8"]
    configs = [("prefix caching off", ["--no-prefix-caching"]), ("prefix caching on", [])]
    results = {label: summary(run_config(ctx, "prefix", label, flags, args)) for label, flags in configs}
    ctx.runs["prefix"] = results
    off, on = results["prefix caching off"], results["prefix caching on"]
    hit_rate = on["prefix_hits"] / on["prefix_queries"] if on["prefix_queries"] else 0.0
    bars(ctx.out / "tuning-prefix.png", "Step 4: prefix caching, a shared system prompt", list(results),
         [("median TTFT ms", [off["ttft_med"], on["ttft_med"]]),
          ("prefill tokens computed", [off["prefill_tokens_computed"], on["prefill_tokens_computed"]]),
          ("output tokens/s", [off["output_tps"], on["output_tps"]])])
    shown = args.copy()
    shown[shown.index(prompts)] = "shared-prefix.jsonl"
    return {
        "prefix_cmd": command_line(shown), "prefix_num_prompts": n,
        "prefix_prompt_tokens": on["input_tokens"] / n,
        "prefix_table": table(["server", "TTFT median ms", "TTFT p99 ms", "prefill tokens computed",
                               "prefix-cache hit rate", "output tok/s"],
                              [[label, r["ttft_med"], r["ttft_p99"], int(r["prefill_tokens_computed"]),
                                f"{(r['prefix_hits'] / r['prefix_queries'] if r['prefix_queries'] else 0):.0%}",
                                r["output_tps"]] for label, r in results.items()]),
        "prefix_hit_rate": hit_rate, "prefix_ttft_change": change(on["ttft_med"], off["ttft_med"]),
        "prefix_ttft_saving": 1 - on["ttft_med"] / off["ttft_med"],
        "prefix_prefill_saving": 1 - on["prefill_tokens_computed"] / max(off["prefill_tokens_computed"], 1),
    }


def grounded_prompts(n: int) -> list[str]:
    """Prompts whose answer quotes the prompt (bench/spec_decode.py's input-grounded workload)."""
    return [INSTRUCTIONS[0].format(PASSAGES[i % len(PASSAGES)]) for i in range(n)]


def step_spec(ctx: Context) -> dict[str, Any]:
    """Speculative decoding: n-gram drafts (the guide's 'no separate model' setup), one request at a time."""
    n = ctx.scale(4, 2)
    prompts = write_prompts(ctx, "grounded", grounded_prompts(n))
    args = ["--dataset", prompts, "--endpoint", "chat", "--output-len", str(ctx.scale(48, 12)),
            "--num-prompts", str(n), "--max-concurrency", "1", "--request-rate", "inf"]
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    configs = [("speculation off", []), ("n-gram, k=3", ["--speculative-config", spec])]
    results = {label: summary(run_config(ctx, "spec", label, flags, args)) for label, flags in configs}
    ctx.runs["spec"] = results
    off, on = results["speculation off"], results["n-gram, k=3"]
    acceptance = on["accepted_tokens"] / on["draft_tokens"] if on["draft_tokens"] else 0.0
    bars(ctx.out / "tuning-spec.png", "Speculative decoding: n-gram drafts, one request at a time",
         list(results), [("median TPOT ms", [off["tpot_med"], on["tpot_med"]]),
                         ("output tokens/s", [off["output_tps"], on["output_tps"]])])
    shown = args.copy()
    shown[shown.index(prompts)] = "grounded.jsonl"
    return {
        "spec_cmd": command_line(shown), "spec_config": spec, "spec_num_prompts": n,
        "spec_table": table(["server", "TPOT median ms", "TTFT median ms", "output tok/s", "drafts accepted"],
                            [[label, r["tpot_med"], r["ttft_med"], r["output_tps"],
                              f"{(r['accepted_tokens'] / r['draft_tokens'] if r['draft_tokens'] else 0):.0%}"]
                             for label, r in results.items()]),
        "spec_acceptance": acceptance, "spec_speedup": on["output_tps"] / off["output_tps"],
        "spec_tpot_change": change(on["tpot_med"], off["tpot_med"]),
    }


STEP_FUNCTIONS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "baseline": step_baseline, "concurrency": step_concurrency, "budget": step_budget, "prefix": step_prefix,
    "spec": step_spec, "peer": peer.run}


if __name__ == "__main__":
    sys.exit(main(STEP_FUNCTIONS, __doc__))
