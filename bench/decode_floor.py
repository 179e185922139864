"""How close is a decode step to the machine's matmul floor?

The floor is the time the model's matmuls alone take, with fused projections (q|k|v as one matrix, gate|up as
one, o, down, and the LM head), random weights of the same shapes, the same threads, in the same run (taken in
turns with the engine's steps: a floor pass, an engine step, and so on). A decode step can never be faster
than that; everything above it is attention, norms, RoPE, sampling, scheduling and Python. Two floors:

  engine's own   the engine's backend's matmul code and weight layout (on the cpu backend: what its
                 calibration chose, e.g. the compiled loop for 1-7 token rows, and the sliced LM head);
  torch's best   the faster of torch's two layouts for the same matmuls: ``F.linear`` with the weights stored
                 [out, in], and with them stored [in, out] (``x @ W``). The engine's own code could be slower
                 than torch can be (an AVX2 CPU running a loop tuned for AVX-512): this floor shows it.

Efficiency = floor / engine step, against each. Where the engine uses the compiled CPU kernels, the same engine on the
plain torch path (torch attention, torch matmuls) is measured beside it, in the same turns, against the
floor of torch's own matmuls.

    python bench/decode_floor.py [--model smollm2] [--batches 1 16 64] [--context 128] [--steps 20]
                                 [--no-profile] [--no-torch-path]

It also splits each batch's profiled step into matmuls, attention (block gathers, K/V writes, the attention
kernel), elementwise and small ops, and time outside any operator (Python), counts the operators per layer
that compute or copy (the batch-1 cost is mostly their number), and prints the top operators of the
largest batch.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from minipaged import Engine, SamplingParams
from minipaged.bench.floor import matmul_pass, random_weights_like, stored_in_out
from minipaged.bench.report import machine_line, save
from minipaged.bench.report import markdown_table as table
from minipaged.bench.requests import random_token_prompts
from minipaged.kernels.cpu_argmax import PROFILER_NAME as ARGMAX_NAME
from minipaged.kernels.cpu_layer_ops import PROFILER_NAMES as LAYER_OP_NAMES
from minipaged.kernels.cpu_linear import PROFILER_NAME as SMALL_BATCH_LINEAR_NAME
from minipaged.kernels.cpu_linear import TILED_PROFILER_NAME as TILED_LINEAR_NAME
from minipaged.kernels.int8 import FIXED_POINT_PROFILER_NAME as FIXED_POINT_INT8_LINEAR_NAME
from minipaged.kernels.int8 import PROFILER_NAME as INT8_LINEAR_NAME
from minipaged.kernels.int8 import TILED_PROFILER_NAME as TILED_INT8_LINEAR_NAME
from minipaged.kernels.cpu_paged_attention import PROFILER_NAME as DECODE_ATTENTION_NAME


def kv_read_ms(num_bytes: int, repeats: int = 5) -> float:
    """Median ms to read ``num_bytes`` of fp32 once, streaming (a sum over a buffer that size): the least
    time any attention kernel needs to look at a decode step's keys and values, which the matmul floor
    leaves out. The buffer is far larger than the caches for the batches that matter."""
    data = torch.ones(max(num_bytes // 4, 1))
    data.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def decode_step_ms(engine: Engine, batch: int, context: int, max_steps: int) -> Iterator[float]:
    """Whole engine steps (schedule, forward, sample, bookkeeping) with ``batch`` decodes, one ms figure per
    ``next()`` (at most ``max_steps``), so that the caller can interleave them with other measurements.
    Closing it aborts the requests."""
    prompts = random_token_prompts(batch, context, context, seed=batch, vocab=engine.model.embed.shape[0])
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=max_steps + 8, ignore_eos=True))
           for p in prompts]
    try:
        while any(s.kind != "decode" for s in engine.step().event.scheduled):
            pass                                         # every prompt's prefill done
        while True:
            event = engine.step().event
            assert len(event.scheduled) == batch and all(s.kind == "decode" for s in event.scheduled)
            yield event.duration_s * 1000
    finally:
        for rid in ids:
            engine.abort(rid)
        engine.reset_prefix_cache()


def side_by_side_ms(floor_passes: list[Callable[[], float]], engines: list[Engine], batch: int, context: int,
                    steps: int) -> list[float]:
    """Median ms of each floor pass and of each engine's decode step, measured in turns: every floor pass,
    a step of each engine, every floor pass again, and so on. This machine's speed drifts by 10% and more
    within a minute (it is shared); measured one after the other, floor and step would see different
    machines, and their ratio would measure the drift. In turns, every figure sees the same ones."""
    streams = [decode_step_ms(engine, batch, context, steps + 1) for engine in engines]
    for stream in streams:
        next(stream)                 # the prompts' prefills and a first decode: from here on, only decodes
    for floor_pass in floor_passes:
        floor_pass()                 # warm-up
    times: list[list[float]] = [[] for _ in range(len(floor_passes) + len(streams))]
    for _ in range(steps):
        for i, floor_pass in enumerate(floor_passes):
            times[i].append(floor_pass())
        for i, stream in enumerate(streams, len(floor_passes)):
            times[i].append(next(stream))
    for stream in streams:
        stream.close()
    return [statistics.median(t) for t in times]


# How the profiler's operators group into what a reader of the model code sees. Anything else that
# computes (norms, RoPE, SiLU, residual adds, argmax, ...) is "elementwise and small ops", the compiled
# layer ops and argmax of the cpu backend included (its RoPE call also writes the step's K/V to the cache).
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", SMALL_BATCH_LINEAR_NAME, TILED_LINEAR_NAME, INT8_LINEAR_NAME,
              FIXED_POINT_INT8_LINEAR_NAME, TILED_INT8_LINEAR_NAME}
ATTENTION_OPS = {DECODE_ATTENTION_NAME,
                 "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
                 "aten::index_select", "aten::index_copy_", "aten::index", "aten::index_put_",
                 "aten::_index_put_impl_"}
SMALL_OPS = {*LAYER_OP_NAMES.values(), ARGMAX_NAME}
# Operators that only make a new view of existing memory or allocate it: no arithmetic, no copy.
METADATA_OPS = {"aten::view", "aten::as_strided", "aten::slice", "aten::select", "aten::transpose", "aten::t",
                "aten::unsqueeze", "aten::squeeze", "aten::reshape", "aten::_reshape_alias", "aten::expand",
                "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::narrow", "aten::detach",
                "aten::alias", "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::lift_fresh",
                "aten::_unsafe_view", "aten::linear", "aten::matmul", "aten::scaled_dot_product_attention",
                "aten::to", "aten::resolve_conj", "aten::resolve_neg", "aten::item", "aten::_local_scalar_dense",
                "aten::permute", "aten::contiguous", "aten::result_type", "aten::is_nonzero"}


def profile_step(engine: Engine, batch: int, context: int, steps: int = 5) -> dict:
    """Where a decode step's time goes, by the profiler: matmuls, attention (gathers, writes, the attention
    kernel), elementwise and small ops, and what no operator accounts for (Python, scheduling, sampling's
    bookkeeping). Also the operators per layer that do work (views and allocations not counted)."""
    from torch.profiler import ProfilerActivity, profile

    prompts = random_token_prompts(batch, context, context, seed=99, vocab=engine.model.embed.shape[0])
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
           for p in prompts]
    while any(s.kind != "decode" for s in engine.step().event.scheduled):
        pass
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        events = [engine.step().event for _ in range(steps)]
    for rid in ids:
        engine.abort(rid)
    step_ms = sum(e.duration_s for e in events) / steps * 1000
    ms = {"matmul": 0.0, "attention": 0.0, "elementwise and small ops": 0.0}
    working_ops = 0
    for op in prof.key_averages():
        self_ms = op.self_cpu_time_total / 1000 / steps
        if op.key in MATMUL_OPS:
            ms["matmul"] += self_ms
        elif op.key in ATTENTION_OPS:
            ms["attention"] += self_ms
        elif op.key.startswith("aten::") or op.key in SMALL_OPS:
            ms["elementwise and small ops"] += self_ms
        if op.key.startswith(("aten::", "minipaged::")) and op.key not in METADATA_OPS:
            working_ops += op.count / steps
    ms["outside any operator (Python)"] = max(0.0, step_ms - sum(ms.values()))
    return {"step_ms": step_ms, "ms": ms, "ops_per_layer": working_ops / engine.model.num_layers,
            "table": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=128, help="prompt tokens of each decoding request")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--no-torch-path", dest="torch_path", action="store_false",
                    help="time only the floor and the default engine in turns (no torch-path engine beside them)")
    args = ap.parse_args()

    engine = Engine(args.model, max_num_seqs=max(args.batches), enable_prefix_caching=False,
                    load_progress=lambda line: print(line) if line.startswith("Attention:") else None)
    backend = engine.backend
    # The same engine on the plain torch attention path, side by side, when the default is the compiled kernel.
    torch_engine = Engine(args.model, max_num_seqs=max(args.batches), enable_prefix_caching=False,
                          attention_backend="torch") if backend.name != "torch" and args.torch_path else None
    side_by_side = torch_engine is not None
    # The same engine with its decode steps' layer loop in Python (each compiled kernel a call of its own), where
    # the backend runs it as one compiled call (kernels/cpu_decode_layers.c): what that call saves.
    loop_engine = None
    if getattr(backend, "_decode_layers", None) is not None:
        loop_engine = Engine(args.model, max_num_seqs=max(args.batches), enable_prefix_caching=False,
                             compiled_decode=False)
    rows, record = [], {"context": args.context, "attention_backend": backend.name,
                        "backend": backend.describe(why=False),
                        "batches": {}}
    # Three floors, in turns with the engine: the engine's own matmul code and layout, and torch's two layouts
    # (the better of which is torch's best). The torch-path engine, if any, is measured against torch's best too.
    engine_weights = random_weights_like(engine.model, backend.prepare_weight)
    out_in_weights = random_weights_like(engine.model)
    in_out_weights = random_weights_like(engine.model, stored_in_out, stored_in_out)
    for batch in args.batches:
        floor_passes = [matmul_pass(engine.model, batch, weights=engine_weights, linear=backend.linear,
                                    lm_head=backend.lm_head),
                        matmul_pass(engine.model, batch, weights=out_in_weights),
                        matmul_pass(engine.model, batch, weights=in_out_weights, lm_head=F.linear)]
        engines = [engine] + ([torch_engine] if side_by_side else []) + ([loop_engine] if loop_engine else [])
        medians = side_by_side_ms(floor_passes, engines, batch, args.context, args.steps)
        floor, out_in, in_out, step = medians[0], medians[1], medians[2], medians[len(floor_passes)]
        best = min(out_in, in_out)
        # Every layer's keys and values of every decode, at the measured steps' mean context length.
        kv_bytes = batch * (args.context + args.steps // 2) * engine.model.kv_bytes_per_token()
        kv_ms = kv_read_ms(kv_bytes)
        row = [batch, floor, out_in, in_out, step, floor / step, best / step, batch / step * 1000, kv_ms,
               (best + kv_ms) / step]
        record["batches"][batch] = {"floor_ms": floor, "torch_out_in_floor_ms": out_in,
                                    "torch_in_out_floor_ms": in_out, "torch_best_floor_ms": best,
                                    "engine_ms": step, "efficiency": floor / step,
                                    "efficiency_vs_torch_best": best / step,
                                    "kv_mib": kv_bytes / 2**20, "kv_read_ms": kv_ms,
                                    "efficiency_incl_kv_read": (best + kv_ms) / step}
        line = (f"batch {batch}: engine {step:.1f} ms; own floor {floor:.1f} ms ({floor / step:.2f}); torch's best "
                f"floor {best:.1f} ms ({best / step:.2f}; [out, in] {out_in:.1f}, [in, out] {in_out:.1f})")
        if side_by_side:                 # the torch-path engine, against torch's best floor
            torch_step = medians[len(floor_passes) + 1]
            row += [torch_step, best / torch_step]
            record["batches"][batch].update(torch_path_ms=torch_step, torch_path_efficiency=best / torch_step)
            line += f" (torch path: step {torch_step:.1f} ms, {best / torch_step:.2f})"
        if loop_engine is not None:       # the same engine, its layer loop in Python
            loop_step = medians[-1]
            row += [loop_step, loop_step / step]
            record["batches"][batch].update(python_loop_ms=loop_step, one_call_speedup=loop_step / step)
            line += f" (layer loop in Python: {loop_step:.1f} ms)"
        rows.append(row)
        print(line, flush=True)
    loop_engine_used = loop_engine is not None
    del torch_engine, loop_engine
    headers = ["batch", "own floor ms", "torch [out, in] ms", "torch [in, out] ms", "engine ms", "vs own floor",
               "vs torch's best", "engine tok/s", "KV read ms", "vs torch's best + KV read"]
    if side_by_side:
        headers += ["torch-path ms", "torch-path vs torch's best"]
    if "python_loop_ms" in next(iter(record["batches"].values())):
        headers += ["layer loop in Python ms", "one call's speed-up"]
    md = (f"### Decode step vs the matmul floor: {args.model}, {args.context}-token contexts\n\n{machine_line()}\n\n"
          f"Engine backend: **{record['backend']}**"
          + (" (torch-path columns: the same engine with `attention_backend='torch'`, same run)"
             if side_by_side else "")
          + (". Layer loop in Python: the same engine with the compiled layer loop for decode steps "
             "(kernels/cpu_decode_layers.c) switched off, same run" if loop_engine_used else "")
          + ". KV read ms: reading the step's keys and values once at this machine's "
          "streaming speed, which attention cannot avoid and the matmul floor leaves out.\n\n"
          + table(headers, rows))
    if args.profile:
        parts, breakdown_rows = {}, []
        for batch in args.batches:
            parts[batch] = profile_step(engine, batch, args.context)
            record["batches"][batch]["profile"] = {k: v for k, v in parts[batch].items() if k != "table"}
            shares = parts[batch]["ms"]
            breakdown_rows.append([batch, parts[batch]["step_ms"], *shares.values(), parts[batch]["ops_per_layer"]])
        md += ("\n\nWhere a profiled decode step's time goes (ms per step; the profiler itself adds a little; "
               "ops/layer counts the operators that compute or copy, not views; while a profiler records, decode "
               "steps run the layer loop in Python, so that each kernel shows):\n\n"
               + table(["batch", "step ms", *next(iter(parts.values()))["ms"].keys(), "ops/layer"], breakdown_rows))
        largest = max(args.batches)
        md += f"\n\nEngine step by operator (batch {largest}, 5 steps):\n\n```\n{parts[largest]['table']}\n```"
    save("decode_floor", record, md)


if __name__ == "__main__":
    main()
