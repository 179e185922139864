#!/usr/bin/env python
"""Benchmark the Triton PagedAttention kernel against "gather the blocks, then SDPA" on a CUDA GPU.

Decode is memory-bound: each step must stream every cached K/V byte of the batch from HBM once, and does
very little math with it. So the honest measure of a decode attention kernel is achieved bandwidth
(bytes it must read / time) as a fraction of the card's peak. The baseline is the engine's torch path
(``paged_attention_torch``): it first copies each request's blocks into contiguous K/V (reading *and*
writing the whole context once more) and then calls ``scaled_dot_product_attention``.

Bytes counted ("ideal" traffic): every K and V element of every request's context once, plus q and out.
Prefill chunks actually re-read K/V once per query tile, so for mixed batches the percentage is a lower
bound on the traffic really moved.

    python bench/paged_attention.py                       # full sweep (needs CUDA)
    python bench/paged_attention.py --batches 1 8 --contexts 4096
    python bench/paged_attention.py --interpret-smoke     # tiny run on CPU in Triton's interpreter

Results are printed and written to bench/out/paged_attention-<card>.{json,md}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

# Peak HBM bandwidth in bytes/s, matched against torch.cuda.get_device_name() (first match wins).
PEAK_BANDWIDTH = [
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),          # SXM ("NVIDIA H100 80GB HBM3")
    ("A100", 2.0e12),           # 80 GB SXM: 2.04e12; the 40 GB cards are lower (~1.56e12)
]

DEFAULT_MIXED = [
    # (name, [(seq_len, q_len), ...])
    ("1 chunk 512 @ctx2k + 63 decodes @4k", [(2048, 512)] + [(4096, 1)] * 63),
    ("4 chunks 256 @ctx1k + 124 decodes @2k", [(1024, 256)] * 4 + [(2048, 1)] * 124),
    ("1 prompt 2048 + 31 decodes @8k", [(2048, 2048)] + [(8192, 1)] * 31),
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256], help="decode batch sizes")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192, 32768],
                   help="decode context lengths (tokens)")
    p.add_argument("--max-tokens", type=int, default=2 ** 21,
                   help="skip decode configs with batch*context above this (memory; default 2M tokens)")
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--no-mixed", action="store_true", help="skip the mixed prefill+decode batches")
    p.add_argument("--num-splits", type=int, default=None, help="force the split-K factor (default: heuristic)")
    p.add_argument("--peak-bandwidth", type=float, default=None,
                   help="the card's peak memory bandwidth in bytes/s (default: looked up from the card name)")
    p.add_argument("--warmup-ms", type=int, default=25)
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where to write the JSON/markdown results (default: bench/out; "
                        "--interpret-smoke writes only when this is given)")
    p.add_argument("--interpret-smoke", action="store_true",
                   help="tiny sizes on CPU in Triton's interpreter: checks the wiring, times mean nothing")
    return p.parse_args(argv)


def import_kernels() -> Any:
    """``minipaged.kernels`` when installed, else the ``kernels`` folder of this checkout."""
    try:
        import minipaged.kernels as kernels
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        import kernels  # type: ignore[no-redef]
    return kernels


def lookup_peak(name: str) -> float | None:
    for key, peak in PEAK_BANDWIDTH:
        if key.lower() in name.lower():
            return peak
    return None


def make_batch(torch: Any, specs: list[tuple[int, int]], args: argparse.Namespace, device: str,
               dtype: Any, seed: int = 0) -> dict[str, Any]:
    """Random q and caches, blocks scattered over the pool in shuffled order (as after a while of serving)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    bs = args.block_size
    needed = [-(-s // bs) for s, _ in specs]
    num_blocks = sum(needed) + 1
    perm = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    tables = torch.zeros((len(specs), max(needed)), dtype=torch.int32, device=device)
    offsets = [0]
    for n in needed:
        offsets.append(offsets[-1] + n)
    for i, n in enumerate(needed):
        tables[i, :n] = perm[offsets[i]:offsets[i] + n]
    shape = (num_blocks, bs, args.num_kv_heads, args.head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    starts = [0]
    for _, q_len in specs:
        starts.append(starts[-1] + q_len)
    q = torch.randn((starts[-1], args.num_heads, args.head_dim), generator=gen, device=device, dtype=dtype)
    seq_list = [s for s, _ in specs]
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                seq_lens=torch.tensor(seq_list, dtype=torch.int32, device=device),
                query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
                seq_list=seq_list, starts=starts)


def ideal_bytes(batch: dict[str, Any], args: argparse.Namespace) -> int:
    elt = batch["q"].element_size()
    kv = sum(batch["seq_list"]) * args.num_kv_heads * args.head_dim * elt * 2
    return kv + 2 * batch["q"].numel() * elt           # q in, out back


def make_timer(args: argparse.Namespace, torch: Any) -> Callable[[Callable[[], Any]], float]:
    if args.interpret_smoke:
        def timer(fn: Callable[[], Any]) -> float:
            fn()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        return timer
    import triton.testing

    def cuda_timer(fn: Callable[[], Any]) -> float:
        return float(triton.testing.do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median"))
    return cuda_timer


def run(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.interpret_smoke:
        os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported
        args.batches, args.contexts = [1, 3], [40, 600]     # 600 tokens: long enough to split
        args.num_heads, args.num_kv_heads, args.head_dim = 8, 2, 32
        mixed = [("1 chunk 24 @ctx40 + 2 decodes @70", [(64, 24), (70, 1), (70, 1)])]
    else:
        mixed = DEFAULT_MIXED
    import torch
    if not args.interpret_smoke and not torch.cuda.is_available():
        print("bench/paged_attention.py needs a CUDA GPU and none was found. "
              "(--interpret-smoke runs a tiny CPU check of the wiring.)", file=sys.stderr)
        return 2
    try:
        import triton
    except ImportError:
        print("bench/paged_attention.py needs Triton (pip install triton; Linux only).", file=sys.stderr)
        return 2
    kernels = import_kernels()
    from importlib import import_module
    tpa = import_module(kernels.__name__ + ".triton_paged_attention")

    device = "cpu" if args.interpret_smoke else "cuda"
    dtype = getattr(torch, args.dtype)
    card = "CPU (Triton interpreter)" if args.interpret_smoke else torch.cuda.get_device_name()
    peak = args.peak_bandwidth or (None if args.interpret_smoke else lookup_peak(card))
    sms = 4 if args.interpret_smoke else torch.cuda.get_device_properties(0).multi_processor_count
    timer = make_timer(args, torch)
    scale = args.head_dim ** -0.5

    workloads: list[tuple[str, list[tuple[int, int]]]] = []
    for b in args.batches:
        for ctx in args.contexts:
            if b * ctx <= args.max_tokens:
                workloads.append((f"decode b={b} ctx={ctx}", [(ctx, 1)] * b))
            else:
                print(f"(skipping decode b={b} ctx={ctx}: batch*context > --max-tokens {args.max_tokens})")
    if not args.no_mixed:
        workloads += mixed

    rows = []
    print(f"# {card}  peak={peak / 1e12 if peak else float('nan'):.2f} TB/s  {args.dtype}  "
          f"heads {args.num_heads}/{args.num_kv_heads}  head_dim {args.head_dim}  block {args.block_size}")
    header = (f"{'workload':<40} {'splits':>6} {'triton ms':>10} {'GB/s':>8} {'% peak':>7} "
              f"{'torch ms':>9} {'speedup':>8} {'max|diff|':>10}")
    print(header)
    for name, specs in workloads:
        batch = make_batch(torch, specs, args, device, dtype)
        tensors = [batch[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc")]
        max_q = max(q for _, q in specs)
        max_s = max(s for s, _ in specs)
        splits = args.num_splits or tpa.choose_num_splits(len(specs), args.num_kv_heads, max_s, max_q, sms)

        def triton_fn() -> Any:
            return tpa.paged_attention_triton(*tensors, scale, max_query_len=max_q, max_seq_len=max_s,
                                              num_splits=args.num_splits)

        def torch_fn() -> Any:
            return kernels.paged_attention_torch(*tensors, scale, host_seq_lens=batch["seq_list"],
                                                 host_query_start_loc=batch["starts"])
        t_triton = timer(triton_fn)
        # The baseline materialises the gathered K/V (and SDPA's GQA fallback may expand it per query head):
        # at the largest sizes it can run out of memory, which is recorded rather than fatal.
        try:
            diff: float | None = (triton_fn().float() - torch_fn().float()).abs().max().item()
            t_torch: float | None = timer(torch_fn)
        except torch.OutOfMemoryError:
            diff = t_torch = None
            torch.cuda.empty_cache()
        nbytes = ideal_bytes(batch, args)
        bw = nbytes / (t_triton * 1e-3)
        row = dict(workload=name, num_reqs=len(specs), num_tokens=int(batch["q"].shape[0]),
                   max_seq_len=max_s, num_splits=splits, triton_ms=t_triton, torch_ms=t_torch,
                   bytes=nbytes, bandwidth=bw, fraction_of_peak=bw / peak if peak else None,
                   speedup=t_torch / t_triton if t_torch else None, max_abs_diff=diff)
        rows.append(row)
        frac = f"{100 * bw / peak:6.1f}%" if peak else f"{'n/a':>7}"
        torch_cols = (f"{t_torch:>9.4f} {t_torch / t_triton:>7.2f}x {diff:>10.2e}" if t_torch is not None
                      else f"{'OOM':>9} {'-':>8} {'-':>10}")
        print(f"{name:<40} {splits:>6} {t_triton:>10.4f} {bw / 1e9:>8.1f} {frac} {torch_cols}")
        del batch, tensors
        if device == "cuda":
            torch.cuda.empty_cache()

    meta = dict(card=card, peak_bandwidth=peak, dtype=args.dtype, num_heads=args.num_heads,
                num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, block_size=args.block_size,
                torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                interpret_smoke=args.interpret_smoke,
                bytes_note="ideal traffic: each request's K and V once, plus q and out")
    if args.out_dir is None and args.interpret_smoke:
        return check_diff(rows, args)
    if args.out_dir is None:
        args.out_dir = Path(__file__).resolve().parent / "out"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", card).strip("-").lower()
    json_path = args.out_dir / f"paged_attention-{slug}.json"
    json_path.write_text(json.dumps(dict(meta=meta, results=rows), indent=2) + "\n")
    md = [f"# PagedAttention: Triton vs gather+SDPA on {card}", "",
          f"{args.dtype}, {args.num_heads} query / {args.num_kv_heads} KV heads, head_dim {args.head_dim}, "
          f"block size {args.block_size}; peak bandwidth "
          f"{f'{peak / 1e12:.2f} TB/s' if peak else 'unknown'}; torch {torch.__version__}, "
          f"triton {triton.__version__}; {meta['date']}.", "",
          "Bandwidth = ideal bytes (K/V of every context once + q + out) / Triton time.", "",
          "| workload | splits | Triton ms | GB/s | % of peak | gather+SDPA ms | speedup |",
          "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        frac = f"{100 * r['fraction_of_peak']:.1f}%" if r["fraction_of_peak"] is not None else "n/a"
        md.append(f"| {r['workload']} | {r['num_splits']} | {r['triton_ms']:.4f} | {r['bandwidth'] / 1e9:.1f} | "
                  f"{frac} | {fmt(r['torch_ms'], '.4f')} | {fmt(r['speedup'], '.2f', 'x')} |")
    md_path = json_path.with_suffix(".md")
    md_path.write_text("\n".join(md) + "\n")
    print(f"wrote {json_path} and {md_path}")
    return check_diff(rows, args)


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "OOM" if value is None else f"{value:{spec}}{suffix}"


def check_diff(rows: list[dict[str, Any]], args: argparse.Namespace) -> int:
    """Exit status 1 when the two implementations disagree (a benchmark of a wrong kernel is worthless)."""
    worst = max((r["max_abs_diff"] for r in rows if r["max_abs_diff"] is not None), default=0.0)
    if worst > (0.05 if args.dtype != "float32" else 1e-3):
        print(f"ERROR: Triton and torch outputs differ by up to {worst:.3g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run())
