"""How close is a decode step to the machine's matmul floor?

The floor is what torch needs for the model's matmuls alone, with fused projections (q|k|v as one matrix,
gate|up as one, o, down, and the LM head), random weights of the same shapes, the same threads, in the same
run. A decode step can never be faster than that; everything above it is attention, norms, RoPE, sampling,
scheduling and Python. Efficiency = floor / engine step.

    python bench/decode_floor.py [--model smollm2] [--batches 1 16 64] [--context 128] [--steps 20]

It also prints the engine step's time by operator (torch.profiler), for the largest batch.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from common import machine_line, random_token_prompts, save, table
from minipaged import Engine, SamplingParams


def matmul_floor_ms(model, batch: int, repeats: int) -> float:
    """Median ms of one decode step's matmuls alone (30 layers x 4 fused projections + LM head)."""
    hidden = model.embed.shape[1]
    gen = torch.Generator().manual_seed(0)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen, dtype=model.dtype) * 0.02

    layers = [(weight(*w.qkv.shape), weight(*w.o.shape), weight(*w.gate_up.shape), weight(*w.down.shape))
              for w in model.layers]
    lm_head = weight(*model.lm_head.shape)
    x = torch.randn(batch, hidden, generator=gen, dtype=model.dtype)
    inter = model.layers[0].down.shape[1]
    mid = torch.randn(batch, inter, generator=gen, dtype=model.dtype)
    attn = torch.randn(batch, model.layers[0].o.shape[1], generator=gen, dtype=model.dtype)
    times = []
    with torch.inference_mode():
        for r in range(repeats + 2):
            start = time.perf_counter()
            for qkv, o, gate_up, down in layers:
                F.linear(x, qkv)
                F.linear(attn, o)
                F.linear(x, gate_up)
                F.linear(mid, down)
            F.linear(x, lm_head)
            if r >= 2:                                   # two warm-up rounds
                times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def engine_decode_ms(engine: Engine, batch: int, context: int, steps: int) -> float:
    """Median ms of a whole engine step (schedule, forward, sample, bookkeeping) with ``batch`` decodes."""
    prompts = random_token_prompts(batch, context, context, seed=batch, vocab=engine.model.embed.shape[0])
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
           for p in prompts]
    while any(s.kind != "decode" for s in engine.step().scheduled):
        pass                                             # every prompt's prefill done
    times = []
    for _ in range(steps):
        event = engine.step()
        assert len(event.scheduled) == batch and all(s.kind == "decode" for s in event.scheduled)
        times.append(event.duration_s)
    for rid in ids:
        engine.abort(rid)
    engine.pop_finished()
    engine.reset_prefix_cache()
    return statistics.median(times) * 1000


def profile_step(engine: Engine, batch: int, context: int) -> str:
    """The top operators of a few decode steps, by CPU time."""
    from torch.profiler import ProfilerActivity, profile

    prompts = random_token_prompts(batch, context, context, seed=99, vocab=engine.model.embed.shape[0])
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)) for p in prompts]
    while any(s.kind != "decode" for s in engine.step().scheduled):
        pass
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            engine.step()
    for rid in ids:
        engine.abort(rid)
    engine.pop_finished()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=128, help="prompt tokens of each decoding request")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    args = ap.parse_args()

    engine = Engine(args.model, max_num_seqs=max(args.batches), enable_prefix_caching=False)
    rows, record = [], {"context": args.context, "batches": {}}
    for batch in args.batches:
        floor = matmul_floor_ms(engine.model, batch, args.steps)
        step = engine_decode_ms(engine, batch, args.context, args.steps)
        floor = min(floor, matmul_floor_ms(engine.model, batch, args.steps))   # again, after: less noise
        rows.append([batch, floor, step, floor / step, batch / step * 1000])
        record["batches"][batch] = {"floor_ms": floor, "engine_ms": step, "efficiency": floor / step}
        print(f"batch {batch}: floor {floor:.1f} ms, engine {step:.1f} ms, efficiency {floor / step:.2f}", flush=True)
    md = (f"### Decode step vs the matmul floor: {args.model}, {args.context}-token contexts\n\n{machine_line()}\n\n"
          + table(["batch", "floor ms", "engine ms", "efficiency", "engine tok/s"], rows))
    if args.profile:
        ops = profile_step(engine, max(args.batches), args.context)
        md += f"\n\nEngine step by operator (batch {max(args.batches)}, 5 steps):\n\n```\n{ops}\n```"
    save("decode_floor", record, md)
    print(md)


if __name__ == "__main__":
    main()
