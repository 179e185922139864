"""``minipaged bench``: measure, tune, re-measure (issue 14).

One module per subcommand: ``throughput`` (an offline batch, optionally against transformers' ``generate``)
and ``latency`` (a batch-size sweep split into prefill and decode). ``requests`` makes the workloads,
``run`` drives the engine, ``report`` writes JSON and pictures, ``baseline`` is the transformers reference.
"""
from __future__ import annotations

import argparse
import sys

from .requests import BenchError

SUBCOMMANDS = ("throughput", "latency")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from . import latency, throughput
    sub = parser.add_subparsers(dest="bench_command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    fmt = argparse.ArgumentDefaultsHelpFormatter
    throughput.add_arguments(sub.add_parser("throughput", formatter_class=fmt, description=throughput.__doc__,
                                            help="requests and tokens per second of an offline batch"))
    latency.add_arguments(sub.add_parser("latency", formatter_class=fmt, description=latency.__doc__,
                                         help="per-step and per-token latency over a batch-size sweep"))


def run_bench(args: argparse.Namespace) -> int:
    from . import latency, throughput
    command = {"throughput": throughput.run, "latency": latency.run}[args.bench_command]
    try:
        return command(args)
    except BenchError as exc:
        print(f"minipaged bench: error: {exc}", file=sys.stderr)
        return 2


__all__ = ["add_bench_arguments", "run_bench", "BenchError"]
