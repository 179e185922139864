"""The lesson side panel of ``minipaged watch --lesson N``, and the live run that feeds a lesson's scenario.

``LessonPanel`` shows a lesson's text (Markdown), its checkpoints, which tick when the run shows the thing,
and a short quiz. It reads StepEvents only: the app calls ``on_step(event, state)`` after showing each event
(``WatchApp.step_listeners``), and the panel hands them to a ``CheckpointTracker`` from
``minipaged.lessons``. So it works the same on a live run, a replayed trace, or events fed by a test.

Keys while the panel has focus (it takes it when it mounts; nothing else in the app is focusable): 1-4
answer the quiz, PageUp/PageDown scroll the text, [ and ] scroll the checkpoints and quiz. Every other key
goes on to the app (space, n, b, arrows).

A checkpoint shows as ticked only while the step that ticked it is on screen: step back before it and it
is open again (the tracker remembers it, so stepping forward ticks it again without a second notice).
"""
from __future__ import annotations

import argparse
from typing import Any, Optional

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Markdown, Static

from minipaged.events import EngineInfo, StepEvent
from minipaged.lessons import CheckpointTracker, Lesson, ScenarioFeed, get_lesson
from minipaged.options import as_flag, build_engine, engine_options
from minipaged.workloads import WORKLOAD_ARG_NAMES, Workload

from .driver import EngineFactory, LiveRun

TICK, NEXT, TODO, OTHER = "✔", "▶", "○", "·"


QUIZ_LINES_TO_SEE = 4        # the quiz's title and the question's first lines


class LessonPanel(Vertical, can_focus=True):
    """Lesson text, checkpoints with ticks, and a quiz, for the right-hand column."""

    DEFAULT_CSS = """
    LessonPanel { height: 1fr; }
    LessonPanel #lesson-title { height: auto; background: $boost; text-style: bold; padding: 0 1; }
    LessonPanel #lesson-text { height: 1fr; min-height: 6; scrollbar-size-vertical: 1; }
    LessonPanel Markdown { padding: 0 1 0 0; margin: 0; }
    LessonPanel #lesson-progress { height: auto; max-height: 45%; border-top: solid $accent; }
    LessonPanel #lesson-checkpoints, LessonPanel #lesson-quiz { height: auto; }
    LessonPanel #lesson-quiz { border-top: dashed $accent 50%; }
    """
    BINDINGS = [
        Binding("1", "answer(0)", "answer the quiz question", show=False),
        Binding("2", "answer(1)", "answer the quiz question", show=False),
        Binding("3", "answer(2)", "answer the quiz question", show=False),
        Binding("4", "answer(3)", "answer the quiz question", show=False),
        Binding("pageup", "scroll_text(-1)", "scroll the lesson text", show=False, key_display="PgUp"),
        Binding("pagedown", "scroll_text(1)", "scroll the lesson text", show=False, key_display="PgDn"),
        Binding("left_square_bracket", "scroll_progress(-1)", "scroll the checkpoints and quiz", show=False,
                key_display="["),
        Binding("right_square_bracket", "scroll_progress(1)", "scroll the checkpoints and quiz", show=False,
                key_display="]"),
    ]

    def __init__(self, lesson: Lesson, *, id: Optional[str] = "lesson") -> None:
        super().__init__(id=id)
        self.lesson = lesson
        self.tracker: Optional[CheckpointTracker] = None
        self.quiz = lesson.render_quiz()
        self.answers: list[int] = []            # the learner's choice for each question answered so far
        self.shown_step: Optional[int] = None   # the step on screen (None: the newest one fed)

    # ------------------------------------------------------------------ layout
    def compose(self) -> ComposeResult:
        yield Static(self._title(), id="lesson-title")
        with VerticalScroll(id="lesson-text", can_focus=False):
            # The title bar above already names the lesson: drop the text's own "# Lesson N" heading.
            yield Markdown(self.lesson.markdown.split("\n", 1)[1].lstrip("\n"), open_links=False)
        with VerticalScroll(id="lesson-progress", can_focus=False):
            yield Static(id="lesson-checkpoints")
            yield Static(id="lesson-quiz")

    def on_mount(self) -> None:
        if self.parent is not None and self.parent.id == "side":      # WatchApp's right-hand column
            self.parent.styles.width = "35%"
            self.parent.styles.min_width = 44
            self.parent.styles.max_width = 72
        listeners = getattr(self.app, "step_listeners", None)
        if listeners is not None:
            listeners.append(self.on_step)
        rewind_listeners = getattr(self.app, "rewind_listeners", None)
        if rewind_listeners is not None:
            rewind_listeners.append(self.on_rewind)
        info = getattr(self.app, "info", None)
        if isinstance(info, EngineInfo):
            self.start(info)
        self.focus()
        self.refresh_progress()

    def _title(self) -> Text:
        text = Text(f"Lesson {self.lesson.number}: {self.lesson.title}")
        if self.tracker is not None:
            variant = self.tracker.variant
            text.append(f"\n{'this run: ' + variant if variant else 'a run with your own options'}", style="dim")
        text.append("\nn step · space run · 1-4 quiz · PgUp/PgDn text · [ ] checkpoints", style="dim italic")
        return text

    # ------------------------------------------------------------------ events in
    def start(self, info: EngineInfo) -> None:
        """A run begins (live: once the model is loaded; replay: at once)."""
        if self.tracker is None or self.tracker.info != info:
            self.tracker = self.lesson.tracker(info)
            self.query_one("#lesson-title", Static).update(self._title())
            self.refresh_progress()

    def on_step(self, event: StepEvent, state: Any) -> None:
        """The app showed ``event``; ``state`` is its WatchState (only ``state.info`` is used)."""
        self.shown_step = event.step
        self.feed(event, state.info)

    def on_rewind(self, state: Any) -> None:
        """The app stepped back: ticks from later steps are open again until those steps are shown."""
        last = state.last_event
        self.shown_step = last.step if last is not None else 0
        self.refresh_progress()

    def feed(self, event: StepEvent, info: EngineInfo) -> list[int]:
        self.start(info)
        assert self.tracker is not None
        new = self.tracker.feed(event)
        for i in new:
            text, _hint = self.lesson.render_checkpoint(i)
            self.app.notify(f"{TICK} {text}", title="Checkpoint", timeout=4)
        if new or self.shown_step is not None:
            self.refresh_progress()
        return new

    # ------------------------------------------------------------------ drawing
    def refresh_progress(self) -> None:
        self.query_one("#lesson-checkpoints", Static).update(self.checkpoints_text())
        self.query_one("#lesson-quiz", Static).update(self.quiz_text())

    def checkpoints_text(self) -> Text:
        lesson, tracker = self.lesson, self.tracker
        active = [i for i in range(len(lesson.checkpoints)) if tracker is None or tracker.active(i)]
        others = [i for i in range(len(lesson.checkpoints)) if i not in active]
        ticked = self.ticked_on_screen()
        out = Text()
        out.append(f"Checkpoints {len(ticked)}/{len(active)} in this run\n", style="bold")
        next_index = next((i for i in active if i not in ticked), None)
        for i in active:
            text, hint = lesson.render_checkpoint(i)
            if i in ticked:
                step, detail = ticked[i]
                out.append(f" {TICK} ", style="bold #59a14f")
                out.append(text)
                out.append(f"  step {step}\n", style="dim")
                if detail:
                    out.append(f"   {detail}\n", style="#59a14f")
            else:
                mark, style = (NEXT, "bold #edc948") if i == next_index else (TODO, "")
                out.append(f" {mark} ", style=style)
                out.append(text + "\n", style=style)
                if i == next_index and hint:
                    out.append(f"   → {hint}\n", style="italic #edc948")
        if others:
            out.append(f"{len(others)} more in the lesson's other runs\n", style="bold dim")
        for i in others:
            text, _hint = lesson.render_checkpoint(i)
            variants = lesson.checkpoints[i].variants or ()
            out.append(f" {OTHER} {text}\n", style="dim")
            if variants:
                out.append(f"   in another run: {lesson.variant_command(variants[0])}\n", style="dim italic")
        return out

    def ticked_on_screen(self) -> dict[int, tuple[int, str]]:
        """The tracker's ticks from the steps up to the one on screen."""
        if self.tracker is None:
            return {}
        return {i: tick for i, tick in self.tracker.ticked.items()
                if self.shown_step is None or tick[0] <= self.shown_step}

    @property
    def asks_quiz(self) -> bool:
        return self.lesson.asks_quiz(self.tracker.variant if self.tracker is not None else None)

    def quiz_text(self) -> Text:
        """The question to answer now, and how the last answer went (not the whole history: it stays short)."""
        out = Text()
        if not self.asks_quiz:
            main = self.lesson.scenario.main_variant
            out.append("Quiz", style="bold")
            out.append(f"  asked in the {main} run: {self.lesson.variant_command(main)}\n", style="dim")
            return out
        right = sum(1 for q, a in zip(self.quiz, self.answers) if q.answer == a)
        out.append(f"Quiz {right}/{len(self.quiz)} right", style="bold")
        if len(self.answers) < len(self.quiz):
            out.append(f"  press 1-{len(self.quiz[len(self.answers)].choices)} to answer", style="dim")
        out.append("\n")
        if self.answers:
            k = len(self.answers) - 1
            q, a = self.quiz[k], self.answers[k]
            ok = a == q.answer
            out.append(f" {TICK if ok else '✗'} Q{k + 1}: ", style="bold #59a14f" if ok else "bold #e15759")
            out.append(("right: " if ok else f"not {a + 1}; it is {q.answer + 1}) ") + q.choices[q.answer] + "\n")
            out.append(f"   {q.explanation}\n", style="dim")
        if len(self.answers) < len(self.quiz):
            q = self.quiz[len(self.answers)]
            out.append(f" Q{len(self.answers) + 1}. {q.question}\n", style="bold")
            for j, choice in enumerate(q.choices):
                out.append(f"   {j + 1}) {choice}\n")
        else:
            out.append(" All answered.\n", style="italic")
        return out

    # ------------------------------------------------------------------ keys
    def action_answer(self, choice: int) -> None:
        if len(self.answers) >= len(self.quiz) or not self.asks_quiz:
            return
        if not self._quiz_in_view():              # never answer a question the learner has not seen
            progress = self.query_one("#lesson-progress", VerticalScroll)
            progress.scroll_to_widget(self.query_one("#lesson-quiz", Static), top=True, animate=False)
            self.app.notify("Here is the quiz: read the question, then press 1-4.", timeout=4)
            return
        if choice >= len(self.quiz[len(self.answers)].choices):
            return
        self.answers.append(choice)
        self.refresh_progress()
        quiz = self.query_one("#lesson-quiz", Static)
        self.call_after_refresh(quiz.scroll_visible, animate=False)

    def _quiz_in_view(self) -> bool:
        """Whether the quiz's first lines (the current question) are on screen in their scroll area.

        Regions come from Textual's last layout, which it paints in the same pass: this judges the frame the
        learner saw. Text updated since (a tick adds a detail line above the quiz) moves the quiz at the next
        layout, not before, so a press that reaches us in between is judged by what was on screen."""
        progress = self.query_one("#lesson-progress", VerticalScroll)
        top = self.query_one("#lesson-quiz", Static).virtual_region.y - round(progress.scroll_offset.y)
        return top >= 0 and (top + QUIZ_LINES_TO_SEE <= progress.size.height or top == 0)

    def action_scroll_text(self, direction: int) -> None:
        self._page("#lesson-text", direction)

    def action_scroll_progress(self, direction: int) -> None:
        self._page("#lesson-progress", direction)

    def _page(self, selector: str, direction: int) -> None:
        scroller = self.query_one(selector, VerticalScroll)
        if direction < 0:
            scroller.scroll_page_up(animate=False)
        else:
            scroller.scroll_page_down(animate=False)

    def on_markdown_link_clicked(self, message: Markdown.LinkClicked) -> None:
        """Links point at source files: say where, rather than opening a browser."""
        message.stop()
        path = self.lesson.source_path(message.href)
        self.app.notify(f"{path}", title="Source (open it in your editor)", timeout=8)


# ---------------------------------------------------------------------------------------- the live run

class LessonRun(LiveRun):
    """A LiveRun that feeds the lesson's scenario (token-id prompts, fixed arrival steps) to the engine,
    by the same rule as the headless runner that measured the lesson's numbers."""

    def __init__(self, build_engine: EngineFactory, lesson: Lesson, record: Optional[str] = None) -> None:
        super().__init__(build_engine, Workload(f"lesson-{lesson.number}", lesson.title, ()), record=record)
        self.lesson = lesson
        self.feed: Optional[ScenarioFeed] = None

    def load(self, progress: Any = lambda message: None) -> EngineInfo:
        info = super().load(progress)
        self.feed = ScenarioFeed(self.lesson.scenario, self.engine.tokenizer)
        return info

    def _add_due_requests(self) -> None:
        assert self.feed is not None
        self.feed.add_due(self.engine, self.steps)

    @property
    def done(self) -> bool:
        """The scenario's requests, not the (empty) workload's, decide when the run is over."""
        waiting = self.feed is None or bool(self.feed.pending)
        return not waiting and not self.engine.has_unfinished_requests()


def one_engine_lesson(number: str) -> Lesson:
    """Lesson ``number``, if ``watch`` can run it: a fleet lesson (several engines behind a router) is seen on
    the fleet page instead, and the ValueError says how to start it."""
    lesson = get_lesson(number)
    if (elsewhere := lesson.scenario.watch_elsewhere(lesson.number)) is not None:
        raise ValueError(elsewhere)
    return lesson


def build_lesson_run(args: argparse.Namespace) -> tuple[Lesson, LessonRun, str]:
    """``minipaged watch --lesson N``: the lesson, its live run and a one-line description.

    The scenario's options win, except for engine flags the user gave: those pick the variant they name
    (``--policy static`` opens lesson 2's static run) and then apply on top.
    """
    workload_flags = [as_flag(name) for name in WORKLOAD_ARG_NAMES if getattr(args, name, None)]
    if workload_flags:
        raise ValueError(f"--lesson {args.lesson} brings its own workload, so {', '.join(workload_flags)} cannot "
                         f"be used with it; engine flags (e.g. --num-blocks) can.")
    lesson = one_engine_lesson(args.lesson)
    variant, options = lesson.options_for(engine_options(args))
    run = LessonRun(lambda progress: build_engine(args.model, options, progress), lesson,
                    record=getattr(args, "record", None))
    which = f"the {variant} run" if variant else "your own options (the lesson's numbers may differ)"
    return lesson, run, f"lesson {lesson.number}: {lesson.title}, {which}"


def build_lesson_compare(args: argparse.Namespace) -> tuple[Lesson, list[tuple[str, LessonRun]], str]:
    """``minipaged watch --lesson N --compare``: the lesson's variants (its first three) side by side, each a
    LessonRun of the same scenario; engine flags the user gave apply to every one of them."""
    lesson = one_engine_lesson(args.lesson)
    # A served lesson's other runs are servers (lesson 12): watch draws the in-process one, the rest are started.
    elsewhere = [lesson.variant_command(name) for name in lesson.scenario.variants
                 if lesson.scenario.variant_command(lesson.number, name) is not None]
    names = [name for name in lesson.scenario.variants
             if lesson.scenario.variant_command(lesson.number, name) is None][:3]
    if len(names) < 2:
        raise ValueError(f"lesson {lesson.number} has a single run that `minipaged watch` draws, so there is nothing "
                         f"to compare; open it without --compare."
                         + "".join(f"\nIts other runs are servers: {command}" for command in elsewhere))
    user = engine_options(args)
    runs = []
    for name in names:
        options = {**lesson.scenario.engine_options(name), **user}
        overrides = " ".join(f"{key}={value}" for key, value in lesson.scenario.variants[name].items())
        label = f"{name} ({overrides})" if overrides else f"{name} (the lesson's options)"
        runs.append((label,
                     LessonRun(lambda progress, o=options: build_engine(args.model, o, progress), lesson)))
    return lesson, runs, f"lesson {lesson.number}: {lesson.title}, its runs side by side"
