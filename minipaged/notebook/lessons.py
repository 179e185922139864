"""A lesson in a notebook: its scenario run on an engine drawn live by the widget, its checkpoints ticked from
the run's StepEvents (the TUI's own ``CheckpointTracker``), its quiz. The generated notebooks
(``minipaged lessons --notebook N``, notebooks.py) call only what is here, so a notebook holds no logic of its own.

The model: the notebook's ``MODEL`` line (the embedded SmolLM2 as generated; CI's test puts a tiny random Llama
there). What a lesson's scheduler does depends on lengths and prefixes only, so either model ticks the same
checkpoints.
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any, Optional

from minipaged.events import StepEvent
from minipaged.lessons.core import CheckpointTracker, Lesson, ScenarioFeed, get_lesson

def _display(obj: Any) -> None:
    try:
        from IPython.display import display
    except ImportError:                                  # plain Python: nothing to draw into
        return
    display(obj)


def _html(markup: str) -> Any:
    try:
        from IPython.display import HTML
    except ImportError:
        return markup
    return HTML(markup)


@dataclass
class LessonNotebook:
    """One lesson's runs in a notebook; ``ticked`` collects each checkpoint's (variant, step, detail)."""

    number: int
    model: str = "smollm2"
    widgets: bool = True
    lesson: Lesson = field(init=False)
    ticked: dict[int, tuple[str, int, str]] = field(default_factory=dict)
    runs: dict[str, int] = field(default_factory=dict)     # variant -> steps run

    def __post_init__(self) -> None:
        self.lesson = get_lesson(self.number)

    # ------------------------------------------------------------------------------------------- variants

    def variants(self) -> list[str]:
        return self.variants_of(self.lesson)

    @staticmethod
    def variants_of(lesson: Lesson) -> list[str]:
        """The runs that tick every checkpoint: the main variant, then each one a checkpoint names."""
        out = [lesson.scenario.main_variant]
        for cp in lesson.checkpoints:
            out += [v for v in (cp.variants or ()) if v not in out]
        return out

    def is_fleet(self) -> bool:
        from minipaged.lessons.fleet import FleetScenario
        return isinstance(self.lesson.scenario, FleetScenario)

    # ------------------------------------------------------------------------------------------- runs

    def run(self, variant: Optional[str] = None, *, keep: int = 2000) -> Any:
        """Run one variant of the scenario; returns the widget drawing it (live while it runs)."""
        variant = variant or self.lesson.scenario.main_variant
        if self.is_fleet():
            return self._run_fleet(variant)
        if self.lesson.scenario.variant_command(self.lesson.number, variant) is not None:
            return self._run_served(variant)
        from minipaged.engine import Engine

        engine = Engine(self.model, **self.lesson.scenario.engine_options(variant))
        view = None
        if self.widgets:
            from .widget import watch
            view = watch(engine, keep=keep)
            _display(view)
        tracker = self.lesson.tracker(engine.info)
        with engine:
            feed = ScenarioFeed(self.lesson.scenario, engine.tokenizer)
            steps = 0
            while True:
                feed.add_due(engine, steps)
                if not engine.has_unfinished_requests():
                    break
                event = engine.step().event
                steps += 1
                self._feed(tracker, variant, event)
                if steps > 5000:
                    raise RuntimeError("the scenario did not finish in 5000 steps")
        if view is not None:
            view.stop()
        self.runs[variant] = steps
        self._say_ticks(variant)
        return view

    def _run_fleet(self, variant: str) -> Any:
        """A fleet lesson: replicas behind sglang-router, run to the end; each replica's run drawn afterwards
        (a slider per replica), its checkpoints ticked from each replica's events."""
        fleet = self.lesson.scenario.run_headless(self.model, variant)
        # (the router's policy is the variant: the replicas cannot tell it)
        shown = [self._tick_and_replay(run, variant, f"<b>replica {i}</b>: {len(run.events)} steps")
                 for i, run in enumerate(fleet.replicas)]
        shown = [widget for widget in shown if widget is not None]
        self.runs[variant] = sum(len(r.events) for r in fleet.replicas)
        self._say_ticks(variant)
        return shown

    def _run_served(self, variant: str) -> Any:
        """A served lesson's server run (lesson 12: ``minipaged serve`` and its streaming clients), run to the end,
        then drawn from the server's own events; its checkpoints ticked from them."""
        run = self.lesson.scenario.run_headless(self.model, variant)
        # (how it was served is the variant: the engine's header cannot tell)
        widget = self._tick_and_replay(run, variant, f"<b>{variant}</b>: {run.generated_tokens} tokens in "
                                       f"{run.wall_s:.2f} s, {len(run.events)} steps")
        self.runs[variant] = len(run.events)
        self._say_ticks(variant)
        return widget

    def _tick_and_replay(self, run: Any, variant: str, caption: str) -> Any:
        """A run that ended elsewhere (a replica, a server): its checkpoints ticked from its events, the tracker
        told the variant (the events' engine cannot tell it), then the run drawn with a slider under
        ``caption``. Returns the widget, or None without widgets."""
        tracker = self.lesson.tracker(run.info)
        tracker.variant = variant
        for event in run.events:
            self._feed(tracker, variant, event)
        if not self.widgets:
            return None
        from .feed import ReplayFeed
        from .widget import EngineWidget
        widget = EngineWidget(keep=max(1, len(run.events)))
        widget.source = ReplayFeed(widget.send, run.info, [ev.to_json() for ev in run.events])
        _display(_html(caption))
        _display(widget)
        return widget

    def _feed(self, tracker: CheckpointTracker, variant: str, event: StepEvent) -> None:
        for i in tracker.feed(event):
            if i not in self.ticked:
                step, detail = tracker.ticked[i]
                self.ticked[i] = (variant, step, detail)

    def _say_ticks(self, variant: str) -> None:
        ticked = [i for i, (v, _s, _d) in self.ticked.items() if v == variant]
        print(f"{variant}: {self.runs[variant]} steps; checkpoints ticked in this run: "
              + (", ".join(str(i + 1) for i in sorted(ticked)) or "none"))

    # ------------------------------------------------------------------------------------------- what it shows

    def checkpoint_rows(self) -> list[tuple[int, str, Optional[tuple[str, int, str]]]]:
        return [(i, self.lesson.render_checkpoint(i)[0], self.ticked.get(i))
                for i in range(len(self.lesson.checkpoints))]

    def all_ticked(self) -> bool:
        return len(self.ticked) == len(self.lesson.checkpoints)

    def checkpoints(self) -> Any:
        """A table of the lesson's checkpoints: ✓ with the run and step that showed each, or what to do."""
        rows = []
        for i, text, tick in self.checkpoint_rows():
            if tick:
                variant, step, detail = tick
                mark, where = "✓", f"{variant}, step {step}" + (f": {html.escape(detail)}" if detail else "")
            else:
                mark, where = "·", html.escape(self.lesson.render_checkpoint(i)[1])
            rows.append(f"<tr><td>{mark}</td><td>{i + 1}. {html.escape(text)}</td><td>{where}</td></tr>")
        done = sum(1 for *_x, t in self.checkpoint_rows() if t)
        table = (f"<p>{done} of {len(self.lesson.checkpoints)} checkpoints ticked</p>"
                 f"<table><tr><th></th><th>checkpoint</th><th>seen in</th></tr>{''.join(rows)}</table>")
        print(f"checkpoints ticked: {done}/{len(self.lesson.checkpoints)}")
        return _html(table)

    def answer(self, question: int, choice: int) -> str:
        """Check your answer to quiz question ``question`` (1-based): ``choice`` is the letter's index (a=0)."""
        q = self.lesson.render_quiz()[question - 1]
        right = choice == q.answer
        return ("right. " if right else f"not quite: the answer is {'abcdefgh'[q.answer]}. ") + q.explanation
