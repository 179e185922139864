"""``CompareApp``: two or three runs of one workload side by side (``minipaged watch --compare``).

It is a ``WatchApp`` whose "event" is one *round*: a tuple with one StepEvent per run (None for a run that
has already finished). Everything WatchApp does with events works unchanged on rounds: the engine worker
thread (here it steps every unfinished engine once per round), queued key presses, the busy sign, speeds,
stepping back by refolding, and quitting only after the round in flight. What changes is the screen: one
column per run, each with its own ``WatchState``, block map, batch panel and gauges, and a footer with one
``RunSummary`` line per run, computed from the steps on screen, so stepping back updates it too.
"""
from __future__ import annotations

import time
from itertools import zip_longest
from typing import Any, Optional, Sequence

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Static

from minipaged.events import EngineInfo, StepEvent

from .app import WatchApp, speed_label
from .compare import CompareRun, RunSummary, summarize
from .state import WatchState
from .widgets.batch import BatchPanel
from .widgets.block_map import BlockMap, legend
from .widgets.gauges import Gauges

Round = tuple[Optional[StepEvent], ...]          # one step of every run (None: that run had finished)


class CompareLive:
    """A CompareRun dressed as WatchApp's ``live``: ``load`` gives every run's EngineInfo, ``step`` one round
    (None once every run has finished), ``close`` closes every run."""

    def __init__(self, compare: CompareRun) -> None:
        self.compare = compare

    def load(self, progress: Any = lambda message: None) -> list[EngineInfo]:
        infos = []
        for label, run in zip(self.compare.labels, self.compare.runs):
            infos.append(run.load(progress=lambda message, label=label: progress(f"{label}: {message}")))
        return infos

    def step(self) -> Optional[Round]:
        if self.compare.done:
            return None
        return tuple(self.compare.step())

    def close(self) -> None:
        for run in self.compare.runs:
            run.close()


def rounds_of(traces: Sequence[Sequence[StepEvent]]) -> list[Round]:
    """Recorded traces lined up step by step; a shorter run is None once it has finished."""
    return [tuple(r) for r in zip_longest(*traces)]


class CompareColumn(Vertical):
    """One run: its label and engine settings, block maps, batch panel and gauges."""

    def __init__(self, label: str, *, presenter: bool = False) -> None:
        super().__init__(classes="compare-column")
        self.label = label
        self.presenter = presenter
        self.info: Optional[EngineInfo] = None
        self.state: Optional[WatchState] = None

    def compose(self) -> ComposeResult:
        yield Static(Text(self.label, style="bold"), classes="compare-label")
        yield BlockMap("gpu", classes="compare-map", presenter=self.presenter)
        yield BlockMap("cpu", classes="compare-cpu-map", presenter=self.presenter)
        yield BatchPanel()
        yield Gauges()

    def start(self, info: EngineInfo) -> None:
        self.info, self.state = info, WatchState(info)
        self.query_one(".compare-cpu-map").display = bool(info.num_cpu_blocks)

    def show(self) -> None:
        label = Text(self.label, style="bold")
        if self.info is not None:
            info = self.info
            label.append(f"  {info.policy}, {info.num_blocks} blocks, budget {info.max_num_batched_tokens}, "
                         f"prefix cache {'on' if info.enable_prefix_caching else 'off'}, "
                         f"preempt {info.preemption_mode}", style="dim")
        self.query_one(".compare-label", Static).update(label)
        self.query_one(".compare-map", BlockMap).show(self.state, None)
        self.query_one(".compare-cpu-map", BlockMap).show(self.state, None)
        self.query_one(BatchPanel).show(self.state)
        self.query_one(Gauges).show(self.state)


class CompareApp(WatchApp):
    """Runs side by side, stepped together: live (``compare=CompareRun``) or from recorded traces
    (``replays=[(label, info, events), ...]``)."""

    TITLE = "minipaged watch --compare"
    CSS_PATH = ["watch.tcss", "compare.tcss"]
    # No request is selected here: with two or three runs a selection would mean a different request in each;
    # and `p` (plot the run) has no single run to draw: record each setting with `watch --record`, then plot it.
    BINDINGS = [b for b in WatchApp.BINDINGS if b.action not in ("select(-1)", "select(1)", "plot")]

    def __init__(self, *, compare: Optional[CompareRun] = None,
                 replays: Optional[Sequence[tuple[str, EngineInfo, list[StepEvent]]]] = None,
                 speed: float = 4.0, paused: bool = False, description: str = "", presenter: bool = False) -> None:
        if (compare is None) == (replays is None):
            raise ValueError("give exactly one of compare= or replays=")
        labels = compare.labels if compare is not None else [label for label, _, _ in replays]
        if not 2 <= len(labels) <= 3:
            raise ValueError(f"--compare takes two or three variants, got {len(labels)}.")
        live = CompareLive(compare) if compare is not None else None
        first = None if replays is None else (replays[0][1], [])
        super().__init__(live=live, replay=first, speed=speed, paused=paused, description=description)
        self.labels = list(labels)
        self.presenter = presenter
        self.infos: list[EngineInfo] = []
        self.state = None
        if replays is not None:
            self.infos = [info for _, info, _ in replays]
            self.events = rounds_of([events for _, _, events in replays])   # type: ignore[arg-type]
            self.status = "replaying recorded traces side by side"

    # ------------------------------------------------------------------ layout
    def compose(self) -> ComposeResult:
        yield Static(id="topbar")
        with Horizontal(id="compare-body"):
            for label in self.labels:
                yield CompareColumn(label, presenter=self.presenter)
        yield Static(legend(), id="legend")
        yield Static(id="summaries")
        yield Footer()

    @property
    def columns(self) -> list[CompareColumn]:
        return list(self.query(CompareColumn).results(CompareColumn))

    def on_mount(self, event: events.Mount) -> None:
        event.prevent_default()          # this replaces WatchApp.on_mount (Textual would run both)
        self.set_class(self.presenter, "presenter")
        if self.infos:
            self._start_columns(self.infos)
        self._restart_ticker()
        if self.live is not None:
            self.run_worker(self._engine_loop, thread=True, exclusive=True, name="engine", group="engine")
        self.refresh_panels()

    def _start_columns(self, infos: Sequence[EngineInfo]) -> None:
        self.infos = list(infos)
        self.info = infos[0]
        for column, info in zip(self.columns, infos):
            column.start(info)
        self.state = self.columns[0].state          # WatchApp's "ready" sign; each column has its own

    # ------------------------------------------------------------------ the engine worker's messages
    def _engine_progress(self, message: str) -> None:
        self.status = f"loading: {message}"
        for block_map in self.query(".compare-map").results(BlockMap):
            block_map.placeholder = f"loading the model: {message}"
        self.refresh_panels()

    def _engine_ready(self, info: Any) -> None:
        self._start_columns(info)
        self.status = self.description or "running"
        self.refresh_panels()

    def _engine_failed(self, message: str) -> None:
        self.engine_error = message
        self.engine_busy = False
        if not self.infos:
            for block_map in self.query(".compare-map").results(BlockMap):
                block_map.placeholder = "the engine did not start (see the message above)"
        self.status = message
        self.notify(message, severity="error", timeout=30)
        self.refresh_panels()

    # ------------------------------------------------------------------ moving through rounds
    def _apply(self, event: Any) -> None:
        for column, step_event in zip(self.columns, event):
            if step_event is not None and column.state is not None:
                column.state.apply(step_event)
        self.position += 1
        self.request_refresh()

    def go_to(self, position: int) -> None:
        position = max(0, min(position, len(self.events)))
        for i, (column, info) in enumerate(zip(self.columns, self.infos)):
            column.state = WatchState.from_events(info, self.run_events(i, position))
        self.state = self.columns[0].state
        self.position = position
        self.refresh_panels()

    def run_events(self, index: int, position: Optional[int] = None) -> list[StepEvent]:
        """Run ``index``'s events among the first ``position`` rounds (all rounds seen if None)."""
        rounds = self.events[:position] if position is not None else self.events
        return [r[index] for r in rounds if r[index] is not None]     # type: ignore[index]

    def summaries(self) -> list[RunSummary]:
        """One RunSummary per run, of the steps on screen."""
        return [summarize(label, self.run_events(i, self.position)) for i, label in enumerate(self.labels)]

    # ------------------------------------------------------------------ drawing
    def refresh_panels(self) -> None:
        self._refresh_pending = False
        self._last_refresh = time.monotonic()
        self.query_one("#topbar", Static).update(self._topbar())
        for column in self.columns:
            column.show()
        lines = Text(no_wrap=True, overflow="ellipsis")
        for i, summary in enumerate(self.summaries()):
            lines.append(("\n" if i else "") + " " + summary.line())
        self.query_one("#summaries", Static).update(lines)

    def _topbar(self) -> Text:
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(" minipaged watch --compare ", style="bold reverse")
        live = self.live is not None
        text.append(" LIVE " if live else " REPLAY ", style="bold #59a14f" if live else "bold #b07aa1")
        text.append(f"round {self.position}" + ("" if live else f"/{len(self.events)}"))
        if self.engine_error:
            text.append("  STOPPED", style="bold red")
        elif self.engine_done and self.position >= len(self.events):
            text.append("  DONE", style="bold #59a14f")
        else:
            text.append("  PAUSED" if self.paused else f"  ▶ {speed_label(self.speed)}",
                        style="bold #edc948" if self.paused else "bold")
        if self.engine_busy:
            queued = f", {self.queued_steps} queued" if self.queued_steps else ""
            text.append(f"  ⏳ round {len(self.events) + 1} running {time.monotonic() - self._busy_since:.1f} s"
                        f"{queued}", style="bold #f28e2b")
        text.append(f"  │ {len(self.labels)} runs of the same workload, one engine step each per round", style="dim")
        text.append("\n")
        text.append(f" {self.status}", style="red" if self.engine_error else "italic")
        return text
