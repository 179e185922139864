"""``minipaged bench latency``: how long a step and a token take as the batch grows.

For each batch size B the bench queues B requests at once and runs them to the end, then reads the step
events: a step that computed any prompt tokens is a *prefill* step (with chunked prefill it may carry decodes
too), a step that only decoded is a *decode* step. A decode step gives every running request one token, so
its duration is the time per output token each request sees; prefill steps are what the first token waits
for. Bigger batches make each step slower but serve more requests with it: the sweep shows the trade.
"""
from __future__ import annotations

import argparse
import statistics
from typing import Any

from ..options import add_engine_arguments, build_engine, engine_options
from . import report
from .requests import describe, make_requests, positive_int
from .run import EngineRun, run_requests, warm_up
from .throughput import add_workload_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser, input_len="128", output_len="32")
    parser.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 4, 16], metavar="B",
                        help="the batch sizes to sweep")
    add_engine_arguments(parser)


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def summarize(batch_size: int, run: EngineRun) -> dict[str, Any]:
    """One batch size's numbers, from its outputs and its step events."""
    prefill = [e for e in run.events if e.num_prefill_tokens > 0]
    decode = [e for e in run.events if e.num_prefill_tokens == 0 and e.num_decode_tokens > 0]
    return {
        "batch_size": batch_size,
        "seconds": run.seconds,
        "input_tokens": run.num_input_tokens,
        "output_tokens": run.num_output_tokens,
        "prefill_tokens": sum(e.num_prefill_tokens for e in run.events),   # computed, i.e. not from the cache
        "decode_tokens": sum(e.num_decode_tokens for e in run.events),
        "steps": len(run.events),
        "prefill_steps": len(prefill),
        "decode_steps": len(decode),
        "mean_step_s": mean([e.duration_s for e in run.events]),
        "mean_prefill_step_s": mean([e.duration_s for e in prefill]),
        "mean_decode_step_s": mean([e.duration_s for e in decode]),      # = time per output token per request
        "prefill_s": sum(e.duration_s for e in prefill),
        "decode_s": sum(e.duration_s for e in decode),
        "model_share": sum(e.model_s for e in run.events) / max(sum(e.duration_s for e in run.events), 1e-12),
        "mean_ttft_s": mean([o.metrics.ttft for o in run.outputs if o.metrics.ttft is not None]),
        "output_tokens_per_s": run.num_output_tokens / run.seconds,
    }


def run(args: argparse.Namespace) -> int:
    report.check_plot_possible(args.plot)
    engine = build_engine(args.model, engine_options(args), progress=lambda m: report.err.print(f"[dim]{m}[/]"))
    warm_up(engine)
    sweep = []
    with report.progress_bar("batch sizes", sum(args.batch_sizes)) as advance:
        for batch_size in args.batch_sizes:
            requests = make_requests(args.dataset, batch_size, args.input_len, args.output_len,
                                     vocab_size=engine.loaded.config.vocab_size, seed=args.dataset_seed,
                                     tokenize=lambda text: engine.tokenizer.encode(text))
            engine.reset_prefix_cache()          # each batch size starts cold: no hits from the previous one
            sweep.append(summarize(batch_size, run_requests(engine, requests, on_progress=advance)))
    print_table(sweep)
    record = {"bench": "latency", "model": args.model, "engine_options": engine_options(args),
              "workload": describe(args), "sweep": sweep}
    report.write_json(args.output_json, record)
    if args.plot:
        plot(record, args.plot)
    return 0


def print_table(sweep: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title="bench latency")
    for header in ("batch", "s", "steps (prefill)", "prefill step ms", "decode step ms", "TTFT ms", "out tok/s",
                   "tok in/out"):
        table.add_column(header, justify="right")
    for r in sweep:
        table.add_row(str(r["batch_size"]), f"{r['seconds']:.3f}", f"{r['steps']} ({r['prefill_steps']})",
                      f"{r['mean_prefill_step_s'] * 1000:.1f}", f"{r['mean_decode_step_s'] * 1000:.1f}",
                      f"{r['mean_ttft_s'] * 1000:.1f}", f"{r['output_tokens_per_s']:.1f}",
                      f"{r['input_tokens']}/{r['output_tokens']}")
    Console().print(table)
    print("decode step = the time per output token each request sees; TTFT = mean time to first token")


def plot(record: dict[str, Any], path: str) -> None:
    sweep = record["sweep"]
    sizes = [r["batch_size"] for r in sweep]
    fig, (ax_step, ax_rate) = report.new_figure(2, f"bench latency: {record['model']}")
    ax_step.plot(sizes, [r["mean_prefill_step_s"] * 1000 for r in sweep], "o-", label="prefill step")
    ax_step.plot(sizes, [r["mean_decode_step_s"] * 1000 for r in sweep], "o-", label="decode step (per token)")
    ax_step.set_xlabel("batch size")
    ax_step.set_ylabel("ms")
    ax_step.legend()
    ax_rate.plot(sizes, [r["output_tokens_per_s"] for r in sweep], "o-", color="tab:green")
    ax_rate.set_xlabel("batch size")
    ax_rate.set_ylabel("output tokens/s")
    for ax in (ax_step, ax_rate):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(size) for size in sizes])
    report.save_figure(fig, path)
