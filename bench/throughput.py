"""Output tokens/s: minipaged vs transformers' padded batched generate, same model, same workload, one run.

A preset of ``minipaged bench throughput --baseline transformers`` (the command does the measuring; this
script fixes the workload the README quotes and keeps its table in bench/out/):

    minipaged bench throughput --num-prompts 64 --input-len 40:400 --output-len 16:128 \\
        --baseline transformers --baseline-batch-size 16

plus what the command does not measure: the share of step time spent outside the forward pass
(scheduling, bookkeeping, batch building) at a steady batch of 32 decodes.

    python bench/throughput.py [--model smollm2] [--requests 64] [--hf-batch 16]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from common import machine_line, random_token_prompts, save, table
from minipaged import Engine, SamplingParams
from minipaged.cli import main as minipaged_main


def overhead_share(engine: Engine, batch: int = 32, steps: int = 40) -> tuple[float, float]:
    """(share of step time outside the forward pass, mean step seconds) for `batch` running decodes."""
    prompts = random_token_prompts(batch, 100, 100, seed=11, vocab=engine.model.embed.shape[0])
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

    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "throughput.json"
        code = minipaged_main(["bench", "throughput", "--model", args.model, "--num-prompts", str(args.requests),
                               "--input-len", "40:400", "--output-len", "16:128", "--dataset-seed", str(args.seed),
                               "--baseline", "transformers", "--baseline-batch-size", str(args.hf_batch),
                               "--output-json", str(result_file)])
        if code != 0:
            raise SystemExit(code)
        record = json.loads(result_file.read_text())
    share, step_s = overhead_share(Engine(args.model))
    ours, theirs = record["minipaged"], record["transformers"]
    md = (f"### Throughput: {args.requests} requests, prompts 40-400 tokens, outputs 16-128 (ignore_eos), "
          f"{args.model}\n\n{machine_line()}\n\n"
          + table(["system", "seconds", "output tok/s"],
                  [["minipaged (continuous batching, paged KV)", ours["seconds"], ours["output_tokens_per_s"]],
                   [f"transformers generate, left-padded batches of {args.hf_batch}", theirs["seconds"],
                    theirs["output_tokens_per_s"]]])
          + f"\n\n**ratio minipaged / transformers: {record['ratio_output_tokens_per_s']:.2f}x**\n\n"
          f"Step time outside the forward pass at batch 32 (scheduling, bookkeeping, batch building): "
          f"**{share:.1%}** of {step_s * 1000:.0f} ms per step.")
    save("throughput", {**record, "overhead_share_batch32": share, "step_s_batch32": step_s}, md)


if __name__ == "__main__":
    main()
