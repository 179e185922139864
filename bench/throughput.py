"""Output tokens/s: minipaged vs transformers' padded batched generate, same model, same workload, one run.

Workload (issue 2): 64 requests, prompts of 40-400 tokens, outputs of 16-128 tokens, ignore_eos.
Also measures the share of step time spent outside the forward pass at a steady batch of 32 decodes.

    python bench/throughput.py [--model smollm2] [--requests 64] [--hf-batch 16]
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from common import hf_padded_generate, machine_line, random_token_prompts, save, table
from minipaged import Engine, SamplingParams


def overhead_share(engine: Engine, batch: int = 32, steps: int = 40) -> tuple[float, float]:
    """(share of step time outside the forward pass, mean step seconds) for `batch` running decodes."""
    prompts = random_token_prompts(batch, 100, 100, seed=11)
    probe = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=steps + 10, ignore_eos=True))
             for p in prompts]
    while any(e.kind != "decode" for e in engine.step().scheduled):
        pass                                   # let every prompt finish its prefill
    total = forward = 0.0
    for _ in range(steps):
        event = engine.step()
        assert len(event.scheduled) == batch
        total += event.duration_s
        forward += event.model_s
    for rid in probe:                          # clean up the remaining tokens of the probe
        engine.abort(rid)
    engine.pop_finished()
    return (total - forward) / total, total / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    engine = Engine(args.model)
    prompts = random_token_prompts(args.requests, 40, 400, seed=args.seed, vocab=engine.model.embed.shape[0])
    rng = random.Random(args.seed + 1)
    max_tokens = [rng.randint(16, 128) for _ in prompts]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]

    engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)   # warm-up
    hf_padded_generate(engine.loaded.hf_model, prompts[:2], [2, 2], 2)
    engine.reset_prefix_cache()

    start = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    engine_s = time.perf_counter() - start
    engine_tokens = sum(len(o.token_ids) for o in outs)
    assert engine_tokens == sum(max_tokens)
    hf_s, hf_tokens = hf_padded_generate(engine.loaded.hf_model, prompts, max_tokens, args.hf_batch)

    share, step_s = overhead_share(engine)
    engine_tps, hf_tps = engine_tokens / engine_s, hf_tokens / hf_s
    md = (f"### Throughput: {args.requests} requests, prompts 40-400 tokens, outputs 16-128 (ignore_eos), "
          f"{args.model}\n\n{machine_line()}\n\n"
          + table(["system", "seconds", "output tok/s"],
                  [["minipaged (continuous batching, paged KV)", engine_s, engine_tps],
                   [f"transformers generate, left-padded batches of {args.hf_batch}", hf_s, hf_tps]])
          + f"\n\n**ratio minipaged / transformers: {engine_tps / hf_tps:.2f}x**\n\n"
          f"Step time outside the forward pass at batch 32 (scheduling, bookkeeping, batch building): "
          f"**{share:.1%}** of {step_s * 1000:.0f} ms per step.")
    save("throughput", {"engine_s": engine_s, "engine_tok_s": engine_tps, "hf_s": hf_s, "hf_tok_s": hf_tps,
                        "ratio": engine_tps / hf_tps, "overhead_share_batch32": share, "step_s_batch32": step_s,
                        "requests": args.requests, "output_tokens": engine_tokens}, md)


if __name__ == "__main__":
    main()
