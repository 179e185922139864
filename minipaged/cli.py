"""The ``minipaged`` command: watch (the TUI), generate, serve, fleet, bench, plot, classroom, lessons, lab.

The engine flags every command shares, and the one way to build an engine from them, live in
``minipaged.options``; ``watch`` defines its own flags in ``minipaged.tui``.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional, Sequence

from .options import HelpFormatter, add_engine_arguments, build_engine, engine_options


def cmd_generate(args: argparse.Namespace) -> int:
    from .request import SamplingParams
    from rich.console import Console
    err = Console(stderr=True)
    # Bad sampling values and a missing prompt are reported before the model is loaded.
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed_sample,
                            max_tokens=args.max_tokens, stop=args.stop or ())
    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        err.print("[red]no prompt given[/]: pass prompts as arguments or on standard input.")
        return 2
    engine = build_engine(args.model, engine_options(args), progress=lambda m: err.print(f"[dim]{m}[/]"))
    ids = []
    asked: dict[str, str] = {}                      # request id -> the prompt as the user typed it
    for prompt in prompts:
        text = prompt
        if args.chat and getattr(engine.tokenizer, "chat_template", None):
            prompt = engine.inputs.chat_prompt([{"role": "user", "content": prompt}])
        ids.append(engine.add_request(prompt, params))
        asked[ids[-1]] = text
    # Stream: one prompt prints as it grows; several print in turn when each finishes.
    stream = ids[0] if len(ids) == 1 else None
    finished = []
    while engine.has_unfinished_requests():
        for delta in engine.step().outputs:
            if delta.request_id == stream and delta.samples[0].text:
                sys.stdout.write(delta.samples[0].text)
                sys.stdout.flush()
            if delta.output is None:
                continue
            out = delta.output
            finished.append(out)
            if stream is None:
                sys.stdout.write(f"--- [{out.request_id}] {asked[out.request_id]}\n{out.text}\n")
            else:
                sys.stdout.write("\n")
            err.print(f"[dim][{out.request_id}] {len(out.token_ids)} tokens, finish={out.finish_reason}, "
                      f"ttft={out.metrics.ttft:.3f}s, cached prompt tokens={out.num_cached_tokens}[/]")
    stats = engine.stats()
    err.print(f"[dim]{timing_line(finished)}[/]", highlight=False, soft_wrap=True)
    err.print(f"[dim]steps={int(stats['steps'])} prefix-cache hit rate={stats['prefix_cache_hit_rate']:.0%} "
              f"preemptions={int(stats['preemptions_recompute'] + stats['preemptions_swap'])}[/]")
    if stats["spec_decode_num_drafts"]:
        drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
        err.print(f"[dim]speculative ({engine.info.speculative}): {int(accepted)} of {int(drafted)} draft tokens "
                  f"accepted ({accepted / drafted:.0%}), {1 + accepted / stats['spec_decode_num_drafts']:.2f} "
                  f"tokens per verification[/]")
    return 0


def timing_line(outputs: list) -> str:
    """How fast the answers came, for the end of ``generate`` (so a flag's speed-up, int8's say, shows): prompt
    tokens, time to first token, and output tokens per second, in all and in the decode phase alone (after each
    request's first token, the part that weight-only quantization speeds up)."""
    got = [o for o in outputs if o.metrics.first_token_time is not None and o.metrics.finished_time is not None]
    if not got:
        return "timing: no request produced a token"
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    tokens = sum(len(o.token_ids) for o in got)
    ttfts = [o.metrics.ttft for o in got]
    start = min(o.metrics.arrival_time for o in got)
    first, end = min(o.metrics.first_token_time for o in got), max(o.metrics.finished_time for o in got)
    ttft = f"TTFT {ttfts[0]:.3f} s" if len(got) == 1 else f"mean TTFT {sum(ttfts) / len(ttfts):.3f} s"
    line = (f"timing: {prompt} prompt tokens, {ttft}, {tokens} output tokens in {end - start:.2f} s: "
            f"{tokens / max(end - start, 1e-9):.1f} tok/s")
    if tokens > len(got) and end > first:
        line += f" ({(tokens - len(got)) / (end - first):.1f} tok/s after the first token)"
    return line


def cmd_lessons(args: argparse.Namespace) -> int:
    """List the lessons, or print one with its numbers filled in (the same as ``python -m minipaged.lessons``)."""
    if args.notebook is not None:
        try:
            from minipaged.notebook.notebooks import write_notebooks
        except ImportError as exc:
            print(f"minipaged lessons --notebook needs nbformat ({exc}): pip install 'minipaged[notebook]'",
                  file=sys.stderr)
            return 2
        try:
            paths = write_notebooks(args.notebook, args.out)
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        for path in paths:
            print(f"wrote {path}")
        return 0
    from minipaged.lessons.__main__ import main as lessons_main
    return lessons_main([args.lesson] if args.lesson else [])


def make_parser() -> argparse.ArgumentParser:
    fmt = HelpFormatter
    parser = argparse.ArgumentParser(prog="minipaged", formatter_class=fmt,
                                     description="A compact LLM inference engine that shows how vLLM-style "
                                                 "serving works: paged KV cache, continuous batching, prefix "
                                                 "caching, chunked prefill, preemption.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = parser.add_subparsers(dest="command", required=True)

    watch = sub.add_parser("watch", help="the live step-by-step TUI", formatter_class=fmt)
    try:
        from minipaged.tui import add_watch_arguments
        add_watch_arguments(watch)
    except ImportError:
        add_engine_arguments(watch)

    gen = sub.add_parser("generate", help="generate text, streaming it", formatter_class=fmt)
    gen.add_argument("prompts", nargs="*", help="prompts (default: one per line on standard input)%(default).0s")
    gen.add_argument("--max-tokens", type=int, default=64, help="most new tokens per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the top tokens covering "
                                                              "this share of the probability (1 = off)")
    gen.add_argument("--top-k", type=int, default=0, help="keep only the k most likely tokens (0 = off)")
    gen.add_argument("--sample-seed", dest="seed_sample", metavar="SEED", type=int, default=None,
                     help="per-request sampling seed: the same seed gives the same text")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--no-chat", dest="chat", action="store_false",
                     help="send the prompt as raw text instead of through the model's chat template "
                          "(default: the chat template, when the model has one)%(default).0s")
    add_engine_arguments(gen)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with /metrics and a live event stream",
                           formatter_class=fmt)
    from .serve import add_serve_arguments
    add_serve_arguments(serve)

    fleet = sub.add_parser("fleet", help="several replicas behind sglang-router (cache-aware routing), and a page "
                                         "that watches them all", formatter_class=fmt)
    from .fleet import add_fleet_arguments
    add_fleet_arguments(fleet)

    classroom = sub.add_parser("classroom", help="serve the attach TUI to browsers (textual-serve): a class "
                                                 "watches one server", formatter_class=fmt)
    from minipaged.tui.classroom import add_classroom_arguments
    add_classroom_arguments(classroom)

    bench = sub.add_parser("bench", help="benchmarks: throughput of an offline batch, latency over batch sizes",
                           formatter_class=fmt)
    from .bench import add_bench_arguments
    add_bench_arguments(bench)

    plot = sub.add_parser("plot", help="draw a recorded run (watch --record): requests over steps, KV blocks, "
                                       "tokens vs the budget", formatter_class=fmt)
    from .plot import add_plot_arguments
    add_plot_arguments(plot)

    export = sub.add_parser("export-html", help="write a recorded run (watch --record) as one web page that opens "
                                                "offline, with a step slider", formatter_class=fmt)
    export.add_argument("trace", help="the JSON-lines trace")
    export.add_argument("-o", "--output", default=None,
                        help="the HTML file to write (default: the trace's name with .html)%(default).0s")

    lessons = sub.add_parser("lessons", help="list the guided lessons, or print one", formatter_class=fmt)
    lessons.add_argument("lesson", nargs="?", default=None,
                         help="print lesson N's text, its numbers filled in from its measured run; open it "
                              "live with: minipaged watch --lesson N%(default).0s")
    lessons.add_argument("--notebook", metavar="N", default=None,
                         help="write lesson N (or 'all') as a Jupyter notebook generated from the lesson: its text, "
                              "its scenario run with the live widget, its checkpoints, its quiz%(default).0s")
    lessons.add_argument("--out", metavar="DIR", default=None,
                         help="the folder --notebook writes into (default: the current folder)%(default).0s")

    lab = sub.add_parser("lab", help="labs: write a piece of the engine, check it, watch it beside the engine's own",
                         formatter_class=fmt)
    from minipaged.lessons.labs.cli import add_lab_arguments
    add_lab_arguments(lab)
    return parser


def entry_point() -> None:
    """The ``minipaged`` console command: run, then leave at once.

    Once torch and transformers are loaded, the interpreter's own shutdown (tearing down thousands of
    module objects) takes one to two seconds, and if a thread is still inside a torch operation (a model
    still loading when the user quits) it can abort with "terminate called without an active exception".
    By the time ``main`` returns the work is done and every file is written (the TUI waits for the step
    in flight), so the command flushes its output and exits without that teardown.
    """
    code = main()
    parallel = sys.modules.get("minipaged.parallel.distributed_runner")
    if parallel is not None:                 # a parallel engine ran: stop its worker processes first
        parallel.close_all()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def is_user_error(exc: Exception) -> bool:
    """An error whose message tells the user what to fix (printed without a traceback). The model's errors
    are checked only if the model module was loaded (only then can they be raised): importing it pulls in
    torch, which thin clients (``watch --attach``, ``--replay``) must not pay for."""
    from .config import ConfigError
    from .request import InvalidRequestError
    kinds: tuple[type, ...] = (ConfigError, InvalidRequestError)
    if "minipaged.model" in sys.modules:
        from .model import ModelNotAvailableError, UnsupportedModelError
        kinds += (ModelNotAvailableError, UnsupportedModelError)
    return isinstance(exc, kinds)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "bench":
            from .bench import run_bench
            return run_bench(args)
        if args.command == "lessons":
            return cmd_lessons(args)
        if args.command == "lab":
            from minipaged.lessons.labs.cli import cmd_lab
            return cmd_lab(args)
        if args.command == "export-html":
            from .web.replay import export_html
            return export_html(args.trace, args.output)
        if args.command == "plot":
            from .plot import run_plot
            return run_plot(args)
        if args.command == "serve":
            from .serve import run_serve
            return run_serve(args)
        if args.command == "fleet":
            from .fleet import run_fleet
            return run_fleet(args)
        if args.command == "classroom":
            from minipaged.tui.classroom import run_classroom
            return run_classroom(args)
        if args.command == "watch":
            from minipaged.tui import run_watch
            return run_watch(args)
    except Exception as exc:
        if not is_user_error(exc):
            raise
        print(f"minipaged: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
