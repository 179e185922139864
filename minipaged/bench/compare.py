"""``minipaged bench compare A.json B.json ...``: the tuning loop's last step, "re-benchmark and compare".

Reads results that one kind of bench wrote, picks each kind's headline numbers, and prints them side by side
with each run's ratio to the first (the baseline). ``--plot`` draws one bar group per headline number.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from . import report
from .requests import BenchError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="+", metavar="RESULT.json",
                        help="results of one kind of bench (--output-json); the first is the baseline")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the comparison (needs matplotlib)")


def headline(record: dict[str, Any]) -> dict[str, float]:
    """The numbers worth comparing, by bench kind; higher-is-better and lower-is-better both appear."""
    kind = record.get("bench")
    if kind == "throughput":
        m = record["minipaged"]
        return {"requests/s": m["requests_per_s"], "output tokens/s": m["output_tokens_per_s"],
                "total tokens/s": m["total_tokens_per_s"]}
    if kind == "latency":
        numbers = {}
        for r in record["sweep"]:
            numbers[f"batch {r['batch_size']}: decode step ms"] = r["mean_decode_step_s"] * 1000
            numbers[f"batch {r['batch_size']}: output tokens/s"] = r["output_tokens_per_s"]
        return numbers
    if kind == "serve":
        numbers = {"requests/s": record["request_throughput"], "output tokens/s": record["output_throughput"],
                   "median TTFT ms": record["ttft"]["median_ms"], "p99 TTFT ms": record["ttft"]["p99_ms"],
                   "median TPOT ms": record["tpot"]["median_ms"], "median E2EL ms": record["e2el"]["median_ms"]}
        if "request_goodput" in record:
            numbers["goodput requests/s"] = record["request_goodput"]
        return numbers
    if kind == "serve-sweep":
        numbers = {}
        for r in record["sweep"]:
            rate = f"rate {r['request_rate']}"
            numbers[f"{rate}: output tokens/s"] = r["output_throughput"]
            numbers[f"{rate}: median TTFT ms"] = r["ttft"]["median_ms"]
            numbers[f"{rate}: median TPOT ms"] = r["tpot"]["median_ms"]
        return numbers
    raise BenchError(f"not a bench result (bench={kind!r}): give files written by --output-json")


def load(path: str) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BenchError(f"{path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise BenchError(f"{path}: not JSON ({exc.msg}); give files written by --output-json") from None


def run(args: argparse.Namespace) -> int:
    report.check_plot_possible(args.plot)
    records = [load(path) for path in args.results]
    kinds = {record.get("bench") for record in records}
    if len(kinds) != 1:
        raise BenchError(f"the results come from different benches ({', '.join(sorted(map(str, kinds)))}); "
                         f"compare results of one kind")
    columns = [headline(record) for record in records]
    names = [name for name in columns[0] if all(name in column for column in columns)]
    if not names:
        raise BenchError("the results share no number to compare (different batch sizes?)")
    print_table(args.results, names, columns)
    if args.plot and kinds == {"serve-sweep"}:            # sweeps read best as lines against the rate
        from .serve import plot_sweeps
        plot_sweeps({Path(path).stem: record for path, record in zip(args.results, records)}, args.plot,
                    "bench compare: request-rate sweeps")
    elif args.plot:
        plot(args.results, names, columns, args.plot)
    return 0


def print_table(paths: list[str], names: list[str], columns: list[dict[str, float]]) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title="bench compare (ratio to the first)")
    table.add_column("metric")
    for path in paths:
        table.add_column(Path(path).stem, justify="right")
    for name in names:
        base = columns[0][name]
        cells = [f"{columns[0][name]:.4g}"] + [f"{c[name]:.4g} ({c[name] / base:.2f}x)" if base else f"{c[name]:.4g}"
                                             for c in columns[1:]]
        table.add_row(name, *cells)
    Console().print(table)


def plot(paths: list[str], names: list[str], columns: list[dict[str, float]], path: str) -> None:
    fig, axes = report.new_figure(len(names), "bench compare")
    labels = [Path(p).stem for p in paths]
    for ax, name in zip(axes, names):
        ax.bar(labels, [c[name] for c in columns], color="tab:blue")
        ax.set_title(name, fontsize=9)
        ax.tick_params(axis="x", labelrotation=30)
    report.save_figure(fig, path)
