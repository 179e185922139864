"""Gauges with history: KV usage, prefix-cache hit rate, tokens per second, step time, TTFT and ITL; and, where
the events carry the step's host and forward times, how busy the device was, with a lane of recent steps (busy.py).

Every number is computed from events (times included: they are the engine's own measurements carried in
each StepEvent), so a replayed trace shows the numbers of the original run, not of the replaying machine.
"""
from __future__ import annotations

from typing import Callable, Optional

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, Sparkline, Static

from ..state import Metric, WatchState
from .busy import busy_title, lane_text

# (id, label, how to read the metric off the state, how to format its latest value)
GAUGES: tuple[tuple[str, str, Callable[[WatchState], Metric], Callable[[Metric], str]], ...] = (
    ("kv", "KV used", lambda s: s.kv_usage, lambda m: f"{(m.last or 0) * 100:5.1f} %"),
    ("hit", "cache hits", lambda s: s.hit_rate, lambda m: f"{(m.last or 0) * 100:5.1f} %"),
    ("tps", "gen tok/s", lambda s: s.tokens_per_s, lambda m: f"{m.last or 0:7.1f}"),
    ("step", "step ms", lambda s: s.step_ms, lambda m: f"{m.last or 0:7.1f}"),
    ("ttft", "TTFT ms", lambda s: s.ttft_ms, lambda m: "      -" if m.last is None else f"{m.last:7.0f}"),
    ("itl", "ITL ms", lambda s: s.itl_ms, lambda m: "      -" if m.last is None else f"{m.last:7.1f}"),
)
# Shown only when the engine speculates: the share of drafts accepted, and tokens per verification.
SPEC_GAUGES: tuple[tuple[str, str, Callable[[WatchState], Metric], Callable[[Metric], str]], ...] = (
    ("accept", "accepted", lambda s: s.acceptance_rate,
     lambda m: "      -" if m.last is None else f"{m.last * 100:5.1f} %"),
    ("acclen", "tok/verify", lambda s: s.acceptance_length,
     lambda m: "      -" if m.last is None else f"{m.last:7.2f}"),
)


class Gauges(Vertical):
    """One row per metric: name, latest value, sparkline of the recent past."""

    def __init__(self, *, id: Optional[str] = None) -> None:
        super().__init__(id=id)
        self.border_title = "Metrics"

    def compose(self) -> ComposeResult:
        for key, label, _get, _fmt in GAUGES + SPEC_GAUGES:
            with Horizontal(classes="gauge-row spec-gauge" if (key, label, _get, _fmt) in SPEC_GAUGES
                            else "gauge-row"):
                yield Label(label, classes="gauge-label")
                yield Label("", id=f"gauge-{key}", classes="gauge-value")
                yield Sparkline([], id=f"spark-{key}", classes="gauge-spark")
        # Why the GPU waits: hidden until a step carries its host and forward times (older traces do not).
        busy_row = Horizontal(classes="gauge-row busy-gauge")
        busy_row.display = False
        with busy_row:
            yield Label("device busy", id="busy-title", classes="gauge-label")
            yield Label("", id="gauge-busy", classes="gauge-value")
            yield Static("", id="busy-lane", classes="gauge-spark")

    def show(self, state: Optional[WatchState]) -> None:
        speculating = state is not None and bool(state.info.speculative)
        for row in self.query(".spec-gauge"):
            row.display = speculating
        for key, _label, get, fmt in GAUGES + (SPEC_GAUGES if speculating else ()):
            value = self.query_one(f"#gauge-{key}", Label)
            spark = self.query_one(f"#spark-{key}", Sparkline)
            metric = get(state) if state is not None else None
            value.update(fmt(metric) if metric is not None else "")
            spark.data = list(metric.history) if metric is not None else []
            spark.visible = len(spark.data) >= 2      # fewer points draw only a baseline or a solid bar
        self._show_busy(state)

    def _show_busy(self, state: Optional[WatchState]) -> None:
        """The busy gauge (share of the recent steps' wall time the device, or the forward pass, was busy) and, in
        the place of a sparkline, the lane of recent steps (busy.py): one row, shown once the events carry the
        times."""
        timed = state is not None and bool(state.lane)
        for widget in self.query(".busy-gauge"):
            widget.display = timed
        if not timed:
            return
        self.query_one("#busy-title", Label).update(busy_title(state))
        self.query_one("#gauge-busy", Label).update(f"{(state.device_busy.last or 0) * 100:5.1f} %")
        lane = self.query_one("#busy-lane", Static)
        lane.update(lane_text(state, lane.size.width or 40))
