"""The lesson side panel, driven with Textual's Pilot: on its own in a minimal app, and inside
``minipaged watch --lesson N`` on a tiny random model. A checkpoint ticks exactly when the run shows it."""
from __future__ import annotations

import logging

import pytest
from pilot_util import run_async, wait_for
from textual.app import App, ComposeResult

from minipaged.cli import make_parser
from minipaged.lessons import get_lesson, run_variant
from minipaged.trace import read_trace
from minipaged.tui.app import WatchApp
from minipaged.tui.lesson_panel import LessonPanel, build_lesson_run


async def leave(pilot, app) -> None:
    """Quit once the engine is idle and the last redraw has happened (WatchApp schedules a redraw up to
    50 ms after each event; quitting before it fires races with the app's shutdown)."""
    await wait_for(pilot, lambda: not app.engine_busy)
    await pilot.pause(0.15)
    await pilot.press("q")


def watch_args(model: str, *extra: str):
    return make_parser().parse_args(["watch", "--model", model, *extra])


def checkpoint_index(lesson, words: str) -> int:
    return next(i for i, cp in enumerate(lesson.checkpoints) if words in cp.text)


@pytest.fixture(autouse=True)
def quiet_engine():
    logging.getLogger("minipaged").setLevel(logging.ERROR)


# ------------------------------------------------------------------------------------ the panel alone

class PanelApp(App):
    def __init__(self, lesson) -> None:
        super().__init__()
        self.lesson = lesson

    def compose(self) -> ComposeResult:
        yield LessonPanel(self.lesson)


@run_async
async def test_panel_ticks_checkpoints_from_events_and_runs_the_quiz(tiny_model):
    lesson = get_lesson(3)
    run = run_variant(lesson.scenario, tiny_model, "cache-on")
    app = PanelApp(lesson)
    async with app.run_test(size=(70, 60)) as pilot:
        panel = app.query_one(LessonPanel)
        assert app.focused is panel
        hit = checkpoint_index(lesson, "cache hit")
        for event in run.events[:2]:
            panel.feed(event, run.info)
        assert hit not in panel.tracker.ticked and "Checkpoints 1/" in str(panel.checkpoints_text())
        assert panel.feed(run.events[2], run.info) == [hit]
        text = str(panel.checkpoints_text())
        assert "✔ a request is admitted reusing cached blocks" in text and "12 blocks reused" in text
        assert "without the cache" in text and "--no-prefix-caching" in text   # the other run's checkpoint
        # The quiz: 1-4 answer the current question; the next one follows. A learner presses a key after seeing
        # the frame drawn from these checkpoints (pause: Textual lays out and paints), and the panel judges by that
        # frame whether the question is on screen: this terminal is tall enough for it to be, below checkpoints
        # grown by the tick's detail line (a shorter one answers the first press by showing the quiz instead).
        quiz = lesson.render_quiz()
        await pilot.pause()
        assert panel._quiz_in_view()
        await pilot.press(str(quiz[0].answer + 1))
        assert panel.answers == [quiz[0].answer]
        wrong = (quiz[1].answer + 1) % len(quiz[1].choices)
        await pilot.pause()
        await pilot.press(str(wrong + 1))
        shown = str(panel.quiz_text())
        assert "Quiz 1/4 right" in shown and "✗ Q2" in shown and quiz[1].explanation in shown
        await pilot.press("pagedown", "pageup")
        for event in run.events[3:]:
            panel.feed(event, run.info)
        assert len(panel.tracker.ticked) == panel.tracker.num_active


@run_async
async def test_a_quiz_out_of_view_is_shown_before_it_can_be_answered():
    """On a small terminal the quiz sits below the checkpoints: the first 1-4 brings it into view, and only
    a press with the question on screen answers it."""
    app = PanelApp(get_lesson(5))
    async with app.run_test(size=(60, 24)) as pilot:
        panel = app.query_one(LessonPanel)
        await pilot.pause()
        assert not panel._quiz_in_view()
        await pilot.press("1")
        await pilot.pause()
        assert panel.answers == [] and panel._quiz_in_view()
        await pilot.press("1")
        assert panel.answers == [0]


def shown_marks(text: str) -> list[str]:
    return [line.split()[0] for line in text.splitlines() if line.startswith(" ") and line.split()
            and line.split()[0] in ("✔", "▶", "○", "·")]


def test_the_count_matches_the_checkpoints_listed_for_this_run(tiny_model):
    """Lesson 3's cache-on run has 8 of the lesson's 9 checkpoints: the count says 8, eight are listed under
    it, and the ninth is listed apart, as another run's."""
    lesson = get_lesson(3)
    run = run_variant(lesson.scenario, tiny_model, "cache-on")
    panel = LessonPanel(lesson)
    panel.tracker = lesson.tracker(run.info)
    text = str(panel.checkpoints_text())
    this_run, other_runs = text.split("more in the lesson's other runs")
    assert "Checkpoints 0/8 in this run" in this_run and len(shown_marks(this_run)) == 8
    assert shown_marks(other_runs) == ["·"]


@run_async
async def test_brackets_scroll_the_checkpoints_and_quiz():
    app = PanelApp(get_lesson(5))
    async with app.run_test(size=(60, 24)) as pilot:
        progress = app.query_one("#lesson-progress")
        await pilot.pause()
        assert progress.max_scroll_y > 0 and progress.scroll_offset.y == 0
        await pilot.press("right_square_bracket")
        await pilot.pause()
        assert progress.scroll_offset.y > 0
        await pilot.press("left_square_bracket")
        await pilot.pause()
        assert progress.scroll_offset.y == 0


@run_async
async def test_the_quiz_is_asked_in_the_main_run_only(tiny_model):
    lesson = get_lesson(2)
    static = run_variant(lesson.scenario, tiny_model, "static")
    app = PanelApp(lesson)
    async with app.run_test(size=(70, 50)) as pilot:
        panel = app.query_one(LessonPanel)
        panel.start(static.info)
        assert panel.tracker.variant == "static"
        shown = str(panel.quiz_text())
        assert "asked in the continuous run: minipaged watch --lesson 2" in shown
        assert lesson.render_quiz()[0].question not in shown
        await pilot.press("1")
        assert panel.answers == []
    main = run_variant(lesson.scenario, tiny_model, "continuous")
    panel = LessonPanel(lesson)
    panel.tracker = lesson.tracker(main.info)
    assert lesson.render_quiz()[0].question in str(panel.quiz_text())


@run_async
async def test_stepping_back_in_a_replay_unticks_later_checkpoints(tiny_model):
    lesson = get_lesson(3)
    run = run_variant(lesson.scenario, tiny_model, "cache-on")
    hit = checkpoint_index(lesson, "cache hit")
    app = WatchApp(replay=(run.info, run.events), paused=True, lesson=lesson)
    async with app.run_test(size=(160, 50)) as pilot:
        panel = app.query_one(LessonPanel)
        for _ in range(3):
            await pilot.press("n")
        await wait_for(pilot, lambda: app.position == 3)
        assert hit in panel.ticked_on_screen() and "✔ a request is admitted reusing" in str(panel.checkpoints_text())
        await pilot.press("b")
        assert hit not in panel.ticked_on_screen()
        assert "✔ a request is admitted reusing" not in str(panel.checkpoints_text())
        assert "Checkpoints 1/8" in str(panel.checkpoints_text())
        await pilot.press("n")
        assert panel.ticked_on_screen()[hit][0] == 3
        await pilot.press("q")


# ------------------------------------------------------------------------------------ inside minipaged watch

@run_async
async def test_watch_lesson_opens_and_a_checkpoint_ticks_after_the_right_steps(tiny_model):
    lesson, live, description = build_lesson_run(watch_args(tiny_model, "--lesson", "3"))
    app = WatchApp(live=live, paused=True, description=description, lesson=lesson)
    async with app.run_test(size=(160, 50)) as pilot:
        await wait_for(pilot, lambda: app.state is not None)
        panel = app.query_one(LessonPanel)
        assert app.query_one("#side").display and panel.tracker.variant == "cache-on"
        assert "lesson 3: Prefix caching" in description
        hit = checkpoint_index(lesson, "cache hit")
        for step in (1, 2):
            await pilot.press("n")
            await wait_for(pilot, lambda: app.position == step)
            assert hit not in panel.tracker.ticked, f"ticked too early, at step {step}"
        await pilot.press("n")                                  # step 3: r2 arrives and is admitted
        await wait_for(pilot, lambda: app.position == 3)
        assert panel.tracker.ticked[hit][0] == 3
        assert "r2: 12 blocks reused (192 tokens)" in panel.tracker.ticked[hit][1]
        # The help screen lists the lesson's own keys beside the app's.
        await pilot.press("question_mark")
        from minipaged.tui.help import HelpScreen
        assert isinstance(app.screen, HelpScreen)
        help_text = " ".join(str(w.render()) for w in app.screen.query("Static"))
        assert "1 2 3 4" in help_text and "answer the quiz question" in help_text
        assert "PgUp PgDn    scroll the lesson text" in help_text and "Pause/Run" in help_text
        await pilot.press("escape")
        # The panel has focus, yet the app's keys still work.
        await pilot.press("down")
        assert app.selected == "r1"
        await pilot.press("b")                                  # back before the hit: open again
        assert app.position == 2 and hit not in panel.ticked_on_screen()
        await pilot.press("n")
        await wait_for(pilot, lambda: app.position == 3)
        assert panel.ticked_on_screen()[hit][0] == 3
        await leave(pilot, app)


@run_async
async def test_flags_open_the_other_run_of_a_lesson(tiny_model):
    lesson, live, description = build_lesson_run(watch_args(tiny_model, "--lesson", "2", "--policy", "static"))
    app = WatchApp(live=live, paused=True, description=description, lesson=lesson)
    async with app.run_test(size=(160, 50)) as pilot:
        await wait_for(pilot, lambda: app.state is not None)
        panel = app.query_one(LessonPanel)
        assert panel.tracker.variant == "static" and app.info.policy == "static"
        idle = checkpoint_index(lesson, "slots sit idle")
        refill = checkpoint_index(lesson, "takes the freed slot")
        assert panel.tracker.active(idle) and not panel.tracker.active(refill)
        for _ in range(4):
            await pilot.press("n")
            await wait_for(pilot, lambda: not app.engine_busy)
        assert idle in panel.tracker.ticked
        await leave(pilot, app)


@pytest.mark.parametrize("size, hinted", [((100, 30), True), ((160, 50), False)])
def test_a_small_terminal_gets_a_hint_when_a_lesson_opens(tiny_model, size, hinted):
    @run_async
    async def check():
        lesson, live, description = build_lesson_run(watch_args(tiny_model, "--lesson", "3"))
        app = WatchApp(live=live, paused=True, description=description, lesson=lesson)
        notes: list[str] = []
        app.notify = lambda message, **kwargs: notes.append(message)      # what the user would see
        async with app.run_test(size=size) as pilot:
            await wait_for(pilot, lambda: app.state is not None)
            assert any("read best at 160x45" in note for note in notes) == hinted, notes
            await leave(pilot, app)
    check()


def test_every_variant_command_opens_that_variant(tiny_model):
    for number in range(1, 6):
        lesson = get_lesson(number)
        for name in lesson.scenario.variants:
            command = lesson.variant_command(name).split()[2:]           # drop "minipaged watch"
            _, run, description = build_lesson_run(watch_args(tiny_model, *command))
            assert f"the {name} run" in description, (number, name, description)


@run_async
async def test_a_recorded_lesson_replays_with_the_same_ticks(tiny_model, tmp_path):
    trace = tmp_path / "lesson5.jsonl"
    args = watch_args(tiny_model, "--lesson", "5", "--preemption-mode", "swap", "--record", str(trace))
    lesson, live, description = build_lesson_run(args)
    app = WatchApp(live=live, speed=0.0, description=description, lesson=lesson)
    async with app.run_test(size=(160, 50)) as pilot:
        await wait_for(pilot, lambda: app.engine_done)
        live_ticks = dict(app.query_one(LessonPanel).tracker.ticked)
        await leave(pilot, app)
    assert checkpoint_index(lesson, "copied to the host pool") in live_ticks
    replay = WatchApp(replay=read_trace(str(trace)), speed=0.0, lesson=lesson)
    async with replay.run_test(size=(160, 50)) as pilot:
        await wait_for(pilot, lambda: replay.position == len(replay.events))
        assert {i: step for i, (step, _) in replay.query_one(LessonPanel).tracker.ticked.items()} == \
               {i: step for i, (step, _) in live_ticks.items()}
        await pilot.press("space")
        await leave(pilot, replay)


def test_flags_given_on_top_of_a_lesson_are_kept_even_when_they_equal_a_default(tiny_model):
    lesson, run, description = build_lesson_run(watch_args(tiny_model, "--lesson", "4", "--max-num-seqs", "256"))
    assert lesson.scenario.engine_options()["max_num_seqs"] != 256
    assert "your own options" in description
    run.load()
    assert run.engine.config.max_num_seqs == 256


def test_watch_lesson_errors_and_plain_mode(tiny_model, capsys):
    from minipaged.tui import run_watch
    assert run_watch(watch_args(tiny_model, "--lesson", "99")) == 2
    assert "no lesson 99" in capsys.readouterr().err
    assert run_watch(watch_args(tiny_model, "--lesson", "3", "--workload", "chat", "--rate", "2")) == 2
    assert "--workload, --rate cannot be used" in capsys.readouterr().err
    assert run_watch(watch_args(tiny_model, "--lesson", "1", "--no-tui")) == 0
    out = capsys.readouterr().out
    assert "Paged KV blocks" in out and "{{" not in out
    # The plain run also shows the checkpoints as they tick, and the quiz with its answers at the end.
    lesson = get_lesson(1)
    assert out.count("✔ checkpoint: ") == len(lesson.checkpoints)
    assert f"checkpoints: {len(lesson.checkpoints)} of {len(lesson.checkpoints)} seen" in out
    quiz = lesson.render_quiz()
    flat = " ".join(out.split())                                   # the console wraps long lines
    asked = flat.index(f"Q{len(quiz)}. {' '.join(quiz[-1].question.split())}")
    assert f"Q1. {' '.join(quiz[0].question.split())}" in flat and flat.index("answers Q1:") > asked


def test_plain_mode_asks_the_quiz_in_the_main_run_only(tiny_model, capsys):
    from minipaged.tui import run_watch
    assert run_watch(watch_args(tiny_model, "--lesson", "2", "--policy", "static", "--no-tui")) == 0
    out = capsys.readouterr().out
    assert "quiz: asked in the continuous run (minipaged watch --lesson 2" in " ".join(out.split())
    assert "answers" not in out
