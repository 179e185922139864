"""``minipaged watch``: see a paged-KV, continuously batched engine work, one step at a time.

The CLI calls ``add_watch_arguments`` to define the flags and ``run_watch`` to run. Textual and the engine
are imported inside them, so that ``minipaged generate`` does not pay for the TUI, and a replay does not
pay for torch. The engine flags and the engine itself come from ``minipaged.options``, as for every command.

Pieces: ``state`` (everything shown, folded from StepEvents), ``driver`` (the live engine fed by a
workload), ``app`` (the Textual app), ``widgets/`` (one panel each), ``plain`` (``--no-tui``).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
from typing import Any, Iterator, Optional

from minipaged.options import add_engine_arguments, as_flag, build_engine, engine_options
from minipaged.workloads import WORKLOAD_ARG_NAMES

DEFAULT_SPEED = 4.0
QUIT_WAIT_S = 10.0         # quitting waits this long at most for the engine's step in flight
# argparse's ArgumentDefaultsHelpFormatter appends "(default: None)" unless the help mentions %(default);
# ".0s" prints it as nothing, so these flags read "(default: the workload's)" instead.
FROM_WORKLOAD = " (default: the workload's)%(default).0s"


def add_watch_arguments(parser: argparse.ArgumentParser) -> None:
    """Every ``minipaged watch`` flag: what to run, how to show it, and every engine option."""
    from minipaged.workloads import DEFAULT_WORKLOAD, PRESETS

    g = parser.add_argument_group("what to run")
    g.add_argument("--workload", choices=list(PRESETS), default=None,
                   help="preset: " + " ".join(f"{name}: {p.description}" for name, p in PRESETS.items())
                   + f" (default: {DEFAULT_WORKLOAD})%(default).0s")
    g.add_argument("--prompts", metavar="FILE", default=None,
                   help="one prompt per line, used instead of the workload's own prompts%(default).0s")
    g.add_argument("--num-requests", type=int, default=None, help="how many requests" + FROM_WORKLOAD)
    g.add_argument("--rate", type=float, default=None,
                   help="arrivals per engine step, e.g. 0.5 = one every two steps" + FROM_WORKLOAD)
    g.add_argument("--max-tokens", type=int, default=None, help="new tokens per request" + FROM_WORKLOAD)
    g.add_argument("--lesson", metavar="N", default=None,
                   help="open guided lesson N (list them: minipaged lessons): its scenario, with the lesson "
                        "text, checkpoints and quiz beside it; engine flags you give pick the run it compares "
                        "with, e.g. --lesson 2 --policy static%(default).0s")
    g.add_argument("--lab", metavar="N", type=int, default=None,
                   help="run your code for lab N (minipaged lab list) inside the live engine, side by side with the "
                        "engine's own%(default).0s")
    g.add_argument("--lab-file", metavar="FILE", default=None,
                   help="your lab file (default: the name `minipaged lab start N` gave it, in this folder)%(default).0s")
    g.add_argument("--compare", nargs="*", metavar="VARIANT", default=None,
                   help="run the workload through two or three engines that differ in the options given as "
                        "name=value, side by side and stepped together, e.g. --compare policy=static "
                        "policy=continuous; with --lesson N and no variants: the lesson's runs; with two or "
                        "three --replay traces: those runs; --no-tui prints one summary line each%(default).0s")

    a = parser.add_argument_group("attach to a server")
    a.add_argument("--attach", metavar="URL", default=None,
                   help="draw a live `minipaged serve` (e.g. http://127.0.0.1:8000) from its event stream; no "
                        "model is loaded here, and a prompt box (/) sends requests to it%(default).0s")
    a.add_argument("--api-key", default=None, help="the server's --api-key, if it has one%(default).0s")

    v = parser.add_argument_group("watching")
    v.add_argument("--replay", metavar="FILE", default=None, action="append",
                   help="replay a recorded trace (no model needed); step back with b or the left arrow; give it "
                        "two or three times with --compare to replay runs side by side%(default).0s")
    v.add_argument("--web", action="store_true",
                   help="with --replay: serve the trace as the browser view (a step slider) instead of the TUI; "
                        "see also `minipaged export-html`%(default).0s")
    v.add_argument("--web-host", default="127.0.0.1", help="with --web: the address to listen on (0.0.0.0: all)")
    v.add_argument("--web-port", type=int, default=8000, help="with --web: the port to listen on")
    v.add_argument("--record", metavar="FILE", default=None, help="write the run's events to a JSON-lines trace%(default).0s")
    v.add_argument("--no-tui", dest="tui", action="store_false",
                   help="print one compact block per step instead of the full-screen app%(default).0s")
    v.add_argument("--speed", type=float, default=DEFAULT_SPEED,
                   help="steps per second shown (0 = as fast as the engine goes); + and - change it")
    v.add_argument("--paused", action="store_true", help="start paused (space runs, n steps once)%(default).0s")
    v.add_argument("--presenter", action="store_true",
                   help="for a projector (120x35 is enough): bigger block cells, and only the block map, batch "
                        "and metrics panels%(default).0s")

    add_engine_arguments(parser)
    parser.epilog = ("The workload suggests engine options (a small pool that visibly fills, a token budget that "
                     "shows chunking); any engine flag you give wins over the suggestion.")


def engine_options_for(args: argparse.Namespace, suggested: dict[str, Any]) -> dict[str, Any]:
    """The engine options: the user's flags, and the workload's suggestions where a flag was left unset."""
    from minipaged.config import suggestions_left

    options = engine_options(args)
    for name, value in suggestions_left(suggested, options).items():
        if name == "max_num_batched_tokens" and options.get("enable_chunked_prefill") is False:
            continue    # without chunking every prompt must fit one step: keep the engine's own budget
        options[name] = value
    return options


def workload_of(args: argparse.Namespace):
    """The workload the flags describe (a preset, maybe with the user's prompts and sizes)."""
    from minipaged.workloads import DEFAULT_WORKLOAD, make_workload, read_prompts_file

    prompts = read_prompts_file(args.prompts) if args.prompts else None
    return make_workload(args.workload or DEFAULT_WORKLOAD, num_requests=args.num_requests, rate=args.rate,
                         max_tokens=args.max_tokens, seed=args.seed or 0, prompts=prompts)


def build_live_run(args: argparse.Namespace):
    """The workload and a LiveRun that will build the engine (in the worker thread, when it loads)."""
    from .driver import LiveRun

    workload = workload_of(args)
    options = engine_options_for(args, workload.engine_options)
    return LiveRun(lambda progress: build_engine(args.model, options, progress), workload, record=args.record)


def run_compare(args: argparse.Namespace, replay_files: list[str]) -> int:
    """``--compare``: two or three runs side by side (or, with --no-tui, one summary line each). The runs
    are the variants given (``--compare A B [C]``), a lesson's own variants (``--lesson N --compare``) or
    recorded traces (``--compare --replay A --replay B``)."""
    from minipaged.trace import read_trace

    from .compare import CompareRun, parse_variant, summarize

    problem = None
    if args.record:
        problem = "--compare cannot --record: record each run on its own, then --compare --replay them."
    elif (replay_files or args.lesson) and args.compare:
        problem = (f"--compare takes no variants with {'--replay' if replay_files else '--lesson'}: "
                   f"{'each trace is one run' if replay_files else 'the lesson brings its own runs'}.")
    elif replay_files and not 2 <= len(replay_files) <= 3:
        problem = f"--compare --replay takes two or three traces, got {len(replay_files)}."
    if problem:
        print(f"minipaged watch: {problem}", file=sys.stderr)
        return 2
    compare = replays = None
    try:
        if replay_files:
            replays = [(os.path.basename(path), *read_trace(path)) for path in replay_files]
            description = "recorded runs side by side"
        elif args.lesson:
            from .lesson_panel import build_lesson_compare
            _lesson, runs, description = build_lesson_compare(args)
            compare = CompareRun.from_runs(runs)
        else:
            workload = workload_of(args)
            base = engine_options_for(args, workload.engine_options)
            variants = [(text, {**base, **parse_variant(text)}) for text in args.compare]
            compare = CompareRun([(text, lambda progress, o=options: build_engine(args.model, o, progress))
                                  for text, options in variants], workload)
            description = f"workload {workload.name}, {len(workload.arrivals)} requests, the same for each run"
    except (OSError, ValueError) as exc:
        print(f"minipaged watch: {exc}", file=sys.stderr)
        return 2
    return _show_compare(args, compare, replays, description)


def run_lab(args: argparse.Namespace) -> int:
    """``--lab N``: the student's code in one engine, the engine's own in the other, one workload, side by side."""
    from pathlib import Path

    from minipaged.lessons.labs import LabFailure, find_lab, load_target

    from .compare import CompareRun

    try:
        lab = find_lab(args.lab)
        path = Path(args.lab_file or lab.file_name)
        target = load_target(path, lab.target)
        workload = workload_of(args)
    except (LabFailure, OSError, ValueError) as exc:
        print(f"minipaged watch: {exc}", file=sys.stderr)
        return 2
    if lab.adapt_workload is not None:
        workload = lab.adapt_workload(workload)
    reference = {**engine_options_for(args, workload.engine_options), **lab.reference_options}
    theirs = {**reference, **(lab.watch_options(str(path)) if lab.watch_options else {})}

    def build_theirs(progress: Any) -> Any:
        engine = build_engine(args.model, theirs, progress)
        if lab.install is not None:
            lab.install(engine, target)
        return engine

    compare = CompareRun([("the engine's own", lambda progress: build_engine(args.model, reference, progress)),
                          (f"yours ({path.name})", build_theirs)], workload)
    return _show_compare(args, compare, None, f"lab {lab.number}: {lab.title}; workload {workload.name}, "
                                              f"{len(workload.arrivals)} requests, the same for both runs")


def _show_compare(args: argparse.Namespace, compare: Any, replays: Any, description: str) -> int:
    """The side-by-side app, or with --no-tui one summary line per run."""
    from .compare import summarize

    if args.tui:
        from .compare_app import CompareApp
        return _run_app(CompareApp(compare=compare, replays=replays, speed=args.speed,
                                   paused=args.paused or bool(args.lesson), description=description,
                                   presenter=getattr(args, "presenter", False)))
    if replays is not None:
        summaries = [summarize(label, events) for label, _info, events in replays]
    else:
        compare.load()
        while not compare.done:
            compare.step()
        summaries = compare.summaries()
    print(f"{description}:")
    for summary in summaries:
        print("  " + summary.line())
    return 0


def _flag_problem(args: argparse.Namespace) -> Optional[str]:
    """Flags that cannot work together or cannot work at all, caught before a model is loaded."""
    if (getattr(args, "speed", None) or 0) < 0:
        return f"--speed must be 0 (as fast as the engine goes) or a positive number of steps per second, " \
               f"not {args.speed}."
    if getattr(args, "lab", None) is not None:
        clashing = [flag for flag, name in (("--replay", "replay"), ("--attach", "attach"), ("--lesson", "lesson"),
                                            ("--record", "record")) if getattr(args, name, None)]
        clashing += ["--compare"] if getattr(args, "compare", None) is not None else []
        if clashing:
            return (f"--lab runs your code and the engine's own side by side, live; it does not combine with "
                    f"{', '.join(clashing)}.")
    if getattr(args, "replay", None) and getattr(args, "attach", None):
        return "--replay shows a recorded run and --attach a live server: give one of them."
    if getattr(args, "replay", None) or getattr(args, "attach", None):
        given = [as_flag(name) for name in engine_options(args)]
        # attached, --max-tokens still sets what the prompt box asks for
        given += [as_flag(name) for name in WORKLOAD_ARG_NAMES
                  if getattr(args, name, None) and not (name == "max_tokens" and getattr(args, "attach", None))]
        if given:
            if getattr(args, "attach", None):
                return (f"--attach draws the server's engine as it runs, so {', '.join(given)} cannot change it; "
                        f"give engine flags to `minipaged serve`.")
            return (f"--replay shows a recorded run as it was, so {', '.join(given)} cannot change it; record "
                    f"a new run with those flags and --record FILE.")
    record = getattr(args, "record", None)
    if record:
        folder = os.path.dirname(os.path.abspath(record))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            return f"cannot record to {record}: the folder {folder} does not exist or is not writable."
    return None


def run_watch(args: argparse.Namespace) -> int:
    """Run ``minipaged watch`` with parsed flags; returns the exit code."""
    from minipaged.trace import read_trace

    if args.replay and args.record:
        print("minipaged watch: --record writes a new trace from a live run; it cannot be combined with --replay.",
              file=sys.stderr)
        return 2
    # --replay may be given up to three times (with --compare); a caller's Namespace may hold one path
    replay_files = [args.replay] if isinstance(args.replay, str) else list(args.replay or [])
    if len(replay_files) > 1 and getattr(args, "compare", None) is None:
        print("minipaged watch: --replay is given once, or two or three times with --compare (side by side).",
              file=sys.stderr)
        return 2
    problem = _flag_problem(args)
    if problem:
        print(f"minipaged watch: {problem}", file=sys.stderr)
        return 2
    if getattr(args, "attach", None):
        return _run_attach(args)
    if getattr(args, "lab", None) is not None:
        return run_lab(args)
    if getattr(args, "web", False):
        if len(replay_files) != 1:
            print("minipaged watch: --web serves one recorded run: give it with --replay FILE.", file=sys.stderr)
            return 2
        from minipaged.web.replay import serve_replay
        return serve_replay(replay_files[0], args.web_host, args.web_port)
    if getattr(args, "compare", None) is not None:
        return run_compare(args, replay_files)
    args.replay = replay_files[0] if replay_files else None
    replay = None
    live = None
    lesson = None
    description = ""
    if args.replay:
        try:
            replay = read_trace(args.replay)
        except (OSError, ValueError) as exc:
            print(f"minipaged watch: cannot replay {args.replay}: {exc}", file=sys.stderr)
            return 2
    if getattr(args, "lesson", None):
        from .lesson_panel import build_lesson_run
        try:
            lesson, lesson_run, description = build_lesson_run(args)
        except ValueError as exc:
            print(f"minipaged watch: {exc}", file=sys.stderr)
            return 2
        if replay is None:
            live = lesson_run
    elif not args.replay:
        try:
            live = build_live_run(args)
        except (OSError, ValueError) as exc:
            print(f"minipaged watch: {exc}", file=sys.stderr)
            return 2
        description = f"workload {live.workload.name}: {live.workload.description}"

    if not args.tui:
        if lesson is not None:
            print(lesson.markdown)
        return _run_plain(replay, live, description, lesson)

    from .app import WatchApp
    # A lesson starts paused: its text says when to press n.
    return _run_app(WatchApp(live=live, replay=replay, speed=args.speed, paused=args.paused or lesson is not None,
                             description=description, lesson=lesson, presenter=getattr(args, "presenter", False)))


def _run_app(app: Any) -> int:
    """Run the full-screen app, let the step in flight finish, and report an engine that failed."""
    with _log_lines_held_back():
        code = app.run()
        app.wait_for_engine(timeout=QUIT_WAIT_S)
    if app.engine_error:
        print(f"minipaged watch: {app.engine_error}", file=sys.stderr)
        return 1
    return code or 0


def _run_attach(args: argparse.Namespace) -> int:
    """``watch --attach URL``: the live server's events, in the app (with a prompt box) or as plain text."""
    from .attach import DEFAULT_PROMPT_MAX_TOKENS, AttachApp, AttachRun, ServerLost

    attach = AttachRun(args.attach, api_key=args.api_key)
    if not args.tui:
        try:
            code = _run_plain(None, attach, f"attached to {attach.url}")
        except ServerLost as exc:                # the server died or froze: not a normal end
            print(f"minipaged watch: {exc}", file=sys.stderr)
            return 1
        except ConnectionError as exc:
            print(f"minipaged watch: {exc}", file=sys.stderr)
            return 2
        if attach.goodbye is not None:
            print(f"minipaged watch: the server said goodbye ({attach.goodbye})", file=sys.stderr)
        return code
    return _run_app(AttachApp(attach, max_tokens=args.max_tokens or DEFAULT_PROMPT_MAX_TOKENS, paused=args.paused))


@contextlib.contextmanager
def _log_lines_held_back() -> Iterator[None]:
    """Log handlers that write to the terminal (the engine's preemption warnings, for one) would scribble
    over the full-screen app. Hold their lines back while it runs and print them once it has exited; the
    event log shows the same events meanwhile."""
    held = io.StringIO()
    swapped = []
    for handler in logging.getLogger().handlers:
        if type(handler) is logging.StreamHandler and handler.stream in (sys.stderr, sys.stdout):
            swapped.append((handler, handler.setStream(held)))
    try:
        yield
    finally:
        for handler, stream in swapped:
            handler.setStream(stream)
        if held.getvalue():
            lines = held.getvalue().splitlines()
            sys.stderr.write(f"The engine logged {len(lines)} line(s) while the app was open (preemption "
                             f"warnings are part of the show, as in vLLM; the event log showed them as ⚠):\n")
            sys.stderr.write(held.getvalue())


def _run_plain(replay: Optional[tuple], live: Any, description: str, lesson: Any = None) -> int:
    from rich.console import Console

    from .plain import print_run

    console = Console()
    if replay is not None:
        info, events = replay
        print_run(console, info, events, lesson=lesson)
        return 0
    info = live.load(progress=lambda message: console.print(f"[dim]{message}[/]"))
    try:
        print_run(console, info, iter(live.step, None), description, lesson=lesson)
    finally:
        live.close()
    return 0


__all__ = ["add_watch_arguments", "run_watch"]
