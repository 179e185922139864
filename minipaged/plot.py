"""A picture of a recorded run: what every request was doing at every step, the KV pool, the token budget.

``minipaged plot TRACE.jsonl -o run.png`` draws a trace that ``minipaged watch --record`` (or any subscriber
writing ``StepEvent``s) saved; the TUI's ``p`` key draws the run on screen. Both read only the events, the
same data the TUI shows, so the picture is what the engine reported, not a second opinion.

Three panels share the step axis:
1. one row per request (in arrival order): waiting, a prefill chunk, decoding, preempted (the step it lost
   its blocks), swapped out, running but given no tokens, finished;
2. KV blocks: held by requests, free but still cached (a later prompt with the same prefix can reuse them),
   and the pool's size;
3. tokens computed per step, prefill and decode, against the token budget (``max_num_batched_tokens``).

This module imports no torch (thin clients use it) and matplotlib only when it draws.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from .events import EngineInfo, StepEvent

# One code per state, in the order the legend lists them; 0 is "not in the engine" (before it arrived,
# after it finished) and stays blank.
STATES = ("waiting", "prefill", "decode", "preempted", "swapped", "running, no tokens", "finished")
STATE_COLOURS = ("#d9d9d9", "#4c78a8", "#59a14f", "#e15759", "#f28e2b", "#b07aa1", "#222222")
DEFAULT_SIZE = (1600, 1000)          # pixels
# The tokens panel's stacked bars, bottom to top: RunTimeline series, colour, legend label.
TOKEN_KINDS = (("prefill_tokens", "#4c78a8", "prefill tokens"),
               ("decode_tokens", "#59a14f", "decode tokens"),
               ("accepted_draft_tokens", "#8cd17d", "drafts accepted"),
               ("rejected_draft_tokens", "#ff9d9a", "drafts rejected"))


class PlotError(ValueError):
    """A run that cannot be drawn, or a file name that cannot be written: the message says what to do."""


@dataclass
class RunTimeline:
    """The run folded into per-step series: everything the picture shows, and nothing drawn yet."""

    steps: list[int]
    request_ids: list[str]                               # arrival order
    states: dict[str, list[Optional[str]]]               # request -> its state at each step (None: absent)
    prefill_tokens: list[int] = field(default_factory=list)
    decode_tokens: list[int] = field(default_factory=list)           # each decode's own last token
    accepted_draft_tokens: list[int] = field(default_factory=list)   # speculative drafts the target kept
    rejected_draft_tokens: list[int] = field(default_factory=list)   # ... and those it threw away
    budget: list[int] = field(default_factory=list)
    blocks_used: list[int] = field(default_factory=list)
    blocks_cached_free: list[int] = field(default_factory=list)
    num_blocks: int = 0

    def state_at(self, request_id: str, step: int) -> Optional[str]:
        return self.states[request_id][self.steps.index(step)]


def build_timeline(info: EngineInfo, events: Sequence[StepEvent]) -> RunTimeline:
    """Fold the events into one state per request per step.

    In a step a request is, in this order of precedence: finished (it produced its last token), preempted
    (it lost its blocks), prefilling or decoding (it had tokens scheduled), swapped out, waiting, or running
    without tokens (the budget ran out before its turn). Before it arrived and after it finished it is absent.
    """
    steps = [ev.step for ev in events]
    states: dict[str, list[Optional[str]]] = {}
    timeline = RunTimeline(steps=steps, request_ids=[], states=states, num_blocks=info.num_blocks)
    for i, ev in enumerate(events):
        for arrival in ev.arrivals:
            if arrival.request_id not in states:
                timeline.request_ids.append(arrival.request_id)
                states[arrival.request_id] = [None] * len(events)

        def mark(request_id: str, state: str) -> None:
            if request_id in states and states[request_id][i] is None:     # the first mark wins
                states[request_id][i] = state

        for finish in ev.finished:
            mark(finish.request_id, "finished")
        for preemption in ev.preempted:
            mark(preemption.request_id, "preempted")
        for scheduled in ev.scheduled:
            mark(scheduled.request_id, scheduled.kind)
        for rid in ev.swapped:
            mark(rid, "swapped")
        for rid in ev.waiting:
            mark(rid, "waiting")
        for rid in ev.running:
            mark(rid, "running, no tokens")
        # With speculative decoding a decode row carries drafts too: split them off, so the picture shows
        # what the budget was spent on (accepted drafts are tokens gained, rejected ones compute wasted).
        accepted = sum(s.num_accepted for s in ev.scheduled if s.kind == "decode")
        rejected = sum(s.num_rejected for s in ev.scheduled if s.kind == "decode")
        timeline.prefill_tokens.append(ev.num_prefill_tokens)
        timeline.decode_tokens.append(ev.num_decode_tokens - accepted - rejected)
        timeline.accepted_draft_tokens.append(accepted)
        timeline.rejected_draft_tokens.append(rejected)
        timeline.budget.append(ev.budget_limit)
        total = ev.num_total_blocks or info.num_blocks
        timeline.blocks_used.append(total - ev.num_free_blocks)
        timeline.blocks_cached_free.append(ev.num_cached_free_blocks)
    return timeline


def parse_size(text: str) -> tuple[int, int]:
    """'1600x1000' -> (1600, 1000), pixels."""
    try:
        width, height = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise PlotError(f"size {text!r}: give it as WIDTHxHEIGHT in pixels, e.g. 1600x1000") from None
    if not (200 <= width <= 10000 and 200 <= height <= 10000):
        raise PlotError(f"size {text!r}: width and height must be 200 to 10000 pixels")
    return width, height


def check_png_path(path: str | Path) -> None:
    """Pictures are PNG files: say so before any work is done (``minipaged bench --plot`` uses this too)."""
    if Path(path).suffix.lower() != ".png":
        raise PlotError(f"{path}: the picture is a PNG; give a file name ending in .png")


def import_matplotlib() -> Any:
    """matplotlib set up to write files (no display needed), or a PlotError that says how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError("drawing needs matplotlib, which is not installed: pip install matplotlib "
                        "(or install minipaged with its [test] extra)") from None
    matplotlib.use("Agg")
    return matplotlib


def draw_run(info: EngineInfo, events: Sequence[StepEvent], path: str | Path,
             size: tuple[int, int] = DEFAULT_SIZE, title: Optional[str] = None) -> Path:
    """Draw the run to a PNG of exactly ``size`` pixels; returns the path written."""
    path = Path(path)
    check_png_path(path)
    if not events:
        raise PlotError("the run has no steps yet: nothing to draw")
    import_matplotlib()
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    timeline = build_timeline(info, events)
    dpi = 100
    fig, (ax_requests, ax_blocks, ax_tokens) = plt.subplots(
        3, 1, figsize=(size[0] / dpi, size[1] / dpi), dpi=dpi, sharex=True,
        gridspec_kw={"height_ratios": [3, 1, 1]})
    fig.suptitle(title or _default_title(info, events))
    first, last = timeline.steps[0], timeline.steps[-1]
    extent = (first - 0.5, last + 0.5, len(timeline.request_ids) - 0.5, -0.5)

    codes = [[0 if s is None else STATES.index(s) + 1 for s in timeline.states[rid]]
             for rid in timeline.request_ids] or [[0] * len(timeline.steps)]
    colours = ListedColormap(["#ffffff", *STATE_COLOURS])
    ax_requests.imshow(codes, aspect="auto", interpolation="nearest", cmap=colours, vmin=0, vmax=len(STATES),
                       extent=extent)
    ax_requests.set_ylabel(f"requests ({len(timeline.request_ids)}, in arrival order)")
    if len(timeline.request_ids) <= 40:
        ax_requests.set_yticks(range(len(timeline.request_ids)), timeline.request_ids, fontsize=7)
    ax_requests.legend(handles=[Patch(color=c, label=s) for s, c in zip(STATES, STATE_COLOURS)],
                       loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)

    ax_blocks.stackplot(timeline.steps, timeline.blocks_used, timeline.blocks_cached_free,
                        colors=["#4c78a8", "#a0cbe8"], labels=["held by requests", "free, still cached"],
                        step="mid")
    ax_blocks.axhline(timeline.num_blocks, color="#222222", linewidth=1, label=f"pool: {timeline.num_blocks}")
    ax_blocks.set_ylabel("KV blocks")
    ax_blocks.set_ylim(0, timeline.num_blocks * 1.08)
    ax_blocks.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)

    bottom = [0] * len(timeline.steps)
    for series, colour, label in TOKEN_KINDS:
        heights = getattr(timeline, series)
        if series.endswith("draft_tokens") and not any(heights):
            continue                           # no speculative decoding in this run: no empty legend entries
        ax_tokens.bar(timeline.steps, heights, width=1.0, bottom=bottom, color=colour, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    # A budget far above what the steps used (2048 tokens, a handful of decodes) would flatten the bars to
    # nothing: then the panel is scaled to the bars and the budget is named in the legend instead.
    most_used, budget = max(bottom), max(timeline.budget)
    if most_used >= budget / 4:
        ax_tokens.step(timeline.steps, timeline.budget, where="mid", color="#e15759", linewidth=1,
                       label="token budget")
        ax_tokens.set_ylim(0, budget * 1.12)
    else:
        ax_tokens.plot([], [], color="#e15759", linewidth=1, label=f"budget {budget} (off scale)")
        ax_tokens.set_ylim(0, max(most_used, 1) * 1.15)
    ax_tokens.set_ylabel("tokens / step")
    ax_tokens.set_xlabel("engine step")
    ax_tokens.set_xlim(first - 0.5, last + 0.5)
    ax_tokens.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)

    fig.subplots_adjust(left=0.08, right=0.84, top=0.93, bottom=0.07, hspace=0.12)
    try:
        fig.savefig(path, dpi=dpi)             # no bbox "tight": the file is exactly the size asked for
    except OSError as exc:
        raise PlotError(f"could not write {path}: {exc}") from None
    finally:
        plt.close(fig)
    return path


def _default_title(info: EngineInfo, events: Sequence[StepEvent]) -> str:
    finished = sum(len(ev.finished) for ev in events)
    preempted = sum(len(ev.preempted) for ev in events)
    return (f"{Path(info.model).name or info.model}: {len(events)} steps, {finished} requests finished, {preempted} preemptions "
            f"({info.preemption_mode}); {info.num_blocks} blocks of {info.block_size} tokens, "
            f"budget {info.max_num_batched_tokens} tokens/step")


def add_plot_arguments(parser: Any) -> None:
    parser.add_argument("trace", help="a trace recorded with: minipaged watch --record FILE.jsonl")
    parser.add_argument("-o", "--output", default="run.png", help="the PNG to write")
    parser.add_argument("--size", default=f"{DEFAULT_SIZE[0]}x{DEFAULT_SIZE[1]}",
                        help="the picture's size in pixels, WIDTHxHEIGHT")
    parser.add_argument("--title", default=None, help="the picture's title (default: what the run was)")


def run_plot(args: Any) -> int:
    """``minipaged plot``: read the trace, draw it, say where it went (errors: exit 2, one line)."""
    import sys

    from .trace import read_trace

    try:
        size = parse_size(args.size)
        try:
            info, events = read_trace(args.trace)
        except FileNotFoundError:
            raise PlotError(f"{args.trace}: no such file; record one with: minipaged watch --record "
                            f"{args.trace}") from None
        except IsADirectoryError:
            raise PlotError(f"{args.trace} is a directory; give the trace file (JSON lines)") from None
        except UnicodeDecodeError:
            raise PlotError(f"{args.trace}: not a minipaged trace (not text); record one with: "
                            f"minipaged watch --record FILE.jsonl") from None
        except ValueError as exc:
            raise PlotError(str(exc)) from None
        path = draw_run(info, events, args.output, size=size, title=args.title)
    except PlotError as exc:
        print(f"minipaged plot: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({len(events)} steps, {size[0]}x{size[1]} pixels)")
    return 0
