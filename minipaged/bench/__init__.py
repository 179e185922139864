"""``minipaged bench``: measure, tune, re-measure (issue 14).

One module per subcommand: ``throughput`` (an offline batch, optionally against transformers' ``generate``),
``latency`` (a batch-size sweep split into prefill and decode) and ``serve`` (an OpenAI-compatible server
under Poisson load); ``compare`` sets results side by side; ``calibrate`` measures the cpu backend's choices
again and overwrites their cached verdict. ``requests`` makes the workloads,
``run`` drives the engine, ``report`` writes JSON and pictures, ``baseline`` is the transformers reference.

The repository's ``bench/`` scripts, which produce the docs' figures, take what they share from here too:
``floor`` (a step's matmuls alone), ``walkthrough`` and ``peer`` (the tuning walkthrough's servers and the
peer comparison), ``docs`` (rendering docs/*.md from their templates and the scripts' JSON).
"""
from __future__ import annotations

import argparse
import sys

from .requests import BenchError

SUBCOMMANDS = ("throughput", "latency", "serve", "compare", "calibrate")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from . import calibrate, compare, latency, serve, throughput
    sub = parser.add_subparsers(dest="bench_command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    from ..options import HelpFormatter as fmt
    throughput.add_arguments(sub.add_parser("throughput", formatter_class=fmt, description=throughput.__doc__,
                                            help="requests and tokens per second of an offline batch"))
    latency.add_arguments(sub.add_parser("latency", formatter_class=fmt, description=latency.__doc__,
                                         help="per-step and per-token latency over a batch-size sweep"))
    serve.add_arguments(sub.add_parser("serve", formatter_class=fmt, description=serve.__doc__,
                                       help="TTFT, TPOT, ITL and throughput of an OpenAI-compatible server"))
    compare.add_arguments(sub.add_parser("compare", formatter_class=fmt, description=compare.__doc__,
                                         help="side-by-side table (and plot) of bench results"))
    calibrate.add_arguments(sub.add_parser("calibrate", formatter_class=fmt, description=calibrate.__doc__,
                                           help="measure the cpu backend's op choices again and cache them"))


def run_bench(args: argparse.Namespace) -> int:
    from . import calibrate, compare, latency, serve, throughput
    commands = {"throughput": throughput.run, "latency": latency.run, "serve": serve.run, "compare": compare.run,
                "calibrate": calibrate.run}
    command = commands[args.bench_command]
    try:
        return command(args)
    except BenchError as exc:
        print(f"minipaged bench: error: {exc}", file=sys.stderr)
        return 2


__all__ = ["add_bench_arguments", "run_bench", "BenchError"]
