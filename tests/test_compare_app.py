"""``minipaged watch --compare`` on screen (CompareApp) and ``--presenter``: Pilot tests and snapshots.

Live tests run the tiny random Llama; replays and snapshots use two traces recorded from it (the same
tiny model, built as in conftest.py) with

    minipaged watch --no-tui --model TINY --workload chat --num-requests 8 --rate 1 --max-tokens 12 \\
        --num-blocks 32 --policy {static,continuous} --record tests/data/compare_{static,continuous}.jsonl

so every number on screen comes from the traces and the pictures are stable.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from pilot_util import run_async, wait_for

from minipaged import Engine
from minipaged.trace import read_trace
from minipaged.tui.app import WatchApp
from minipaged.tui.compare import CompareRun, parse_variant
from minipaged.tui.compare_app import CompareApp, CompareColumn
from minipaged.tui.widgets.block_map import BlockMap
from minipaged.workloads import make_workload

DATA = Path(__file__).parent / "data"
POLICIES = ("static", "continuous")


def replays() -> list:
    return [(policy, *read_trace(str(DATA / f"compare_{policy}.jsonl"))) for policy in POLICIES]


def steps_on_screen(app: CompareApp) -> list[int]:
    return [column.state.view.step for column in app.columns]


@run_async
async def test_live_compare_steps_together_to_the_end_and_back(tiny_model):
    workload = make_workload("chat", num_requests=8, rate=1.0, max_tokens=12)
    variants = [(f"policy={p}", parse_variant(f"policy={p}")) for p in POLICIES]
    compare = CompareRun([(text, lambda progress, o=options: Engine(tiny_model, num_blocks=32, **o))
                          for text, options in variants], workload)
    app = CompareApp(compare=compare, paused=True)
    async with app.run_test(size=(160, 45)) as pilot:
        await wait_for(pilot, lambda: app.state is not None)
        await pilot.press("n")
        await wait_for(pilot, lambda: app.position == 1)
        assert steps_on_screen(app) == [1, 1]                  # one press, one step of each engine
        while not (app.engine_done and app.position == len(app.events)):
            await pilot.press("n")
            await wait_for(pilot, lambda: not app.engine_busy)
            assert app.position < 200
        static, continuous = app.summaries()
        assert static.steps > continuous.steps                  # static waits for the whole batch to finish
        assert [len(events) for events in compare.events] == [static.steps, continuous.steps]
        shown = str(app.query_one("#summaries").render())
        assert f"policy=static: {static.steps} steps" in shown
        assert f"policy=continuous: {continuous.steps} steps" in shown
        assert all(not owners for column in app.columns for owners in column.state.view.block_owners)
        # b goes back one round in every column: the static run (still going then) and the continuous one
        back_to = continuous.steps - 1
        app.go_to(continuous.steps)
        await pilot.press("b")
        assert app.position == back_to and steps_on_screen(app) == [back_to, back_to]
        assert app.summaries()[1].steps == back_to
        await pilot.press("q")
    assert app.return_code == 0


@run_async
async def test_replayed_runs_side_by_side_step_and_go_back_together():
    app = CompareApp(replays=replays(), paused=True)
    async with app.run_test(size=(160, 45)) as pilot:
        assert len(app.columns) == 2 and app.position == 0
        await pilot.press("n", "n", "n")
        assert steps_on_screen(app) == [3, 3]
        await pilot.press("b")
        assert steps_on_screen(app) == [2, 2]
        maps = app.query(".compare-map").results(BlockMap)
        assert [m.border_title.split(":")[1].strip() for m in maps] == [
            f"{sum(1 for o in c.state.view.block_owners if o)}/32 in use" for c in app.columns]
        app.go_to(len(app.events))                               # past the continuous run's last step
        static_events, continuous_events = (len(r[2]) for r in replays())
        assert len(app.events) == max(static_events, continuous_events) == static_events
        assert steps_on_screen(app) == [static_events, continuous_events]
        await pilot.press("b")                                  # the finished run stays at its end
        assert steps_on_screen(app) == [static_events - 1, continuous_events]


def test_compare_app_takes_two_or_three_runs():
    with pytest.raises(ValueError, match="two or three"):
        CompareApp(replays=replays()[:1])


def test_compare_snapshot(snap_compare):
    async def go(pilot) -> None:
        pilot.app.go_to(8)                 # continuous has filled its pool; static still runs its first batch
        await pilot.pause()

    assert snap_compare(CompareApp(replays=replays(), paused=True), terminal_size=(160, 45), run_before=go)


# ------------------------------------------------------------------------------------------ presenter

@run_async
async def test_presenter_shows_map_batch_and_gauges_with_bigger_cells():
    trace = read_trace(str(DATA / "watch_trace.jsonl"))
    normal, presenter = WatchApp(replay=trace, paused=True), WatchApp(replay=trace, paused=True, presenter=True)
    grids = []
    for app in (normal, presenter):
        async with app.run_test(size=(120, 35)) as pilot:
            app.go_to(11)
            await pilot.pause()
            visible = {name: app.query_one(name).region.area > 0
                       for name in ("#gpu-map", "#batch", "#gauges", "#requests", "#log", "#output")}
            grids.append(app.query_one("#gpu-map", BlockMap).grid)
        if app is presenter:
            assert visible == {"#gpu-map": True, "#batch": True, "#gauges": True,
                               "#requests": False, "#log": False, "#output": False}
        else:
            assert all(visible.values())
    assert grids[1].cell_height > grids[0].cell_height and grids[1].cell_width > grids[0].cell_width


def test_presenter_snapshot(snap_compare):
    async def go(pilot) -> None:
        pilot.app.go_to(11)
        await pilot.pause()

    app = WatchApp(replay=read_trace(str(DATA / "watch_trace.jsonl")), paused=True, presenter=True)
    assert snap_compare(app, terminal_size=(120, 35), run_before=go)


@run_async
async def test_lesson_compare_opens_the_lessons_runs_side_by_side(tiny_model):
    from minipaged.cli import make_parser
    from minipaged.tui.help import HelpScreen
    from minipaged.tui.lesson_panel import build_lesson_compare

    _lesson, runs, description = build_lesson_compare(make_parser().parse_args(
        ["watch", "--model", tiny_model, "--lesson", "2", "--compare"]))
    app = CompareApp(compare=CompareRun.from_runs(runs), paused=True, description=description)
    async with app.run_test(size=(160, 45)) as pilot:
        await wait_for(pilot, lambda: app.state is not None)
        assert [c.info.policy for c in app.columns] == ["continuous", "static"]
        await pilot.press("n")
        await wait_for(pilot, lambda: app.position == 1 and not app.engine_busy)
        assert steps_on_screen(app) == [1, 1]
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape", "q")
