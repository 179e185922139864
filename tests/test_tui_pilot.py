"""Drive ``minipaged watch`` with Textual's Pilot: keys, selection, help, quit; replay against a live run.

Replay tests use the committed trace (no model). Live tests run a tiny random Llama written to a temp
folder, which loads in well under a second (importing torch is the slow part).
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from minipaged.trace import read_trace
from minipaged.tui.app import SPEEDS, WatchApp
from minipaged.tui.driver import LiveRun
from minipaged.tui.help import HelpScreen
from minipaged.tui.widgets.block_map import BlockMap
from minipaged.workloads import Workload
from pilot_util import run_async, wait_for

TRACE = Path(__file__).parent / "data" / "watch_trace.jsonl"


def replay_app(**kw) -> WatchApp:
    return WatchApp(replay=read_trace(str(TRACE)), paused=True, **kw)


def map_picture(app: WatchApp) -> list[list[tuple[str, str]]]:
    """The GPU block map exactly as drawn: (text, style) of every segment of every line."""
    block_map = app.query_one("#gpu-map", BlockMap)
    return [[(seg.text, str(seg.style)) for seg in block_map.render_line(y)]
            for y in range(block_map.content_size.height)]


# ----------------------------------------------------------------------------------------- replay

@run_async
async def test_space_pauses_and_resumes():
    app = replay_app(speed=0.0)                    # full speed once running
    async with app.run_test(size=(120, 40)) as pilot:
        assert app.paused and app.position == 0
        await pilot.press("space")
        assert not app.paused
        await wait_for(pilot, lambda: app.position >= 3)
        await pilot.press("space")
        assert app.paused
        frozen = app.position
        await pilot.pause(0.3)
        assert app.position == frozen


@run_async
async def test_n_steps_once_and_b_steps_back():
    app = replay_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("n")
        assert app.position == 1 and app.state.view.step == 1
        await pilot.press("n", "n", "right")
        assert app.position == 4
        owners_at_4 = [list(o) for o in app.state.view.block_owners]
        await pilot.press("n", "b", "left")
        assert app.position == 3 and app.paused
        await pilot.press("n")
        assert app.state.view.block_owners == owners_at_4   # back then forward lands on the same state


@run_async
async def test_speed_keys_change_the_pace():
    app = replay_app(speed=4.0)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("plus")
        assert app.speed == SPEEDS[SPEEDS.index(4.0) + 1]
        await pilot.press("minus", "minus")
        assert app.speed == SPEEDS[SPEEDS.index(4.0) - 1]


@run_async
async def test_selecting_a_request_highlights_its_blocks():
    app = replay_app()
    async with app.run_test(size=(160, 50)) as pilot:
        app.go_to(12)
        await pilot.pause()
        first = app.selected
        assert first == "r0"                             # the first arrival is selected by default
        await pilot.press("down")
        second = app.selected
        assert second != first
        block_map = app.query_one("#gpu-map", BlockMap)
        owned = set(app.state.view.requests[second].blocks)
        group = block_map.grid.group
        lit = {i for i, cell in enumerate(block_map.cells) if cell.selected}
        assert lit == {b // group for b in owned} and lit
        # A lit cell is drawn at full colour, other owners' cells are dimmed.
        other = next(i for i, c in enumerate(block_map.cells) if c.owner and not c.selected)
        lit_line = block_map.render_line(min(lit) // block_map.grid.cols * (1 + block_map.grid.row_gap))
        assert app.state.colour(second) in str([seg.style for seg in lit_line])
        assert block_map.cells[other].owner != second
        # The output panel follows the selection.
        assert second in str(app.query_one("#output").border_title)
        await pilot.press("up")
        assert app.selected == first


@run_async
async def test_a_finished_selection_does_not_dim_the_map():
    """Once the selected request has finished it holds no block: the others must not stay dimmed."""
    app = replay_app()
    async with app.run_test(size=(160, 50)) as pilot:
        position = next(i for i in range(1, len(app.events) + 1)
                        if any(f.request_id == "r0" for f in app.events[i - 1].finished))
        app.select("r0")                                   # picked by the user: it stays selected
        app.go_to(position)
        await pilot.pause()
        assert app.selected == "r0" and app.state.view.requests["r0"].state == "finished"
        block_map = app.query_one("#gpu-map", BlockMap)
        assert any(c.owner for c in block_map.cells)
        lines = lambda: [block_map.render_line(y) for y in range(block_map.content_size.height)]
        with_finished_selected = lines()
        block_map.selected = None
        assert lines() == with_finished_selected


@run_async
async def test_the_default_selection_follows_a_running_request():
    """Nobody picked r0: when it finishes, the selection (table cursor, output panel) moves to the oldest
    running request instead of staying on a finished one."""
    app = replay_app()
    async with app.run_test(size=(160, 50)) as pilot:
        position = next(i for i in range(1, len(app.events) + 1)
                        if any(f.request_id == "r0" for f in app.events[i - 1].finished))
        for _ in range(position):
            await pilot.press("n")
        assert app.state.view.requests["r0"].state == "finished"
        assert app.selected == app.state.queues()["running"][0] != "r0"
        assert app.selected in str(app.query_one("#output").border_title)


@run_async
async def test_clicking_a_block_selects_its_owner():
    app = replay_app()
    async with app.run_test(size=(160, 50)) as pilot:
        app.go_to(12)
        await pilot.pause()
        block_map = app.query_one("#gpu-map", BlockMap)
        g = block_map.grid
        index = next(i for i, c in enumerate(block_map.cells) if c.owner and c.owner != app.selected
                     and c.kind == "used")
        target = block_map.cells[index].owner
        # Content starts after the border (1 column, 1 row) and the padding (1 column).
        x = 2 + (index % g.cols) * g.cell_width
        y = 1 + (index // g.cols) * (1 + g.row_gap)
        await pilot.click("#gpu-map", offset=(x, y))
        assert app.selected == target


@run_async
async def test_help_lists_every_key_and_closes():
    app = replay_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        shown = " ".join(str(w.render()) for w in app.screen.query("Static"))
        for words in ["space", "Pause/Run", "Step", "Back", "Faster", "Slower", "Quit", "Help", "?", "←", "→"]:
            assert words in shown, words
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


@run_async
async def test_q_quits():
    app = replay_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0


@run_async
async def test_a_failing_engine_is_reported_not_fatal():
    def broken(progress):
        progress("pretending to load")
        raise RuntimeError("no such model")

    app = WatchApp(live=LiveRun(broken, Workload("t", "", ())), paused=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.engine_error is not None)
        assert "no such model" in app.engine_error
        placeholder = app.query_one("#gpu-map").placeholder     # it said "loading the model: pretending ..."
        assert "loading" not in placeholder and "did not start" in placeholder
        await pilot.press("n")                          # keys still work; nothing to step
        await pilot.press("q")


# ----------------------------------------------------------------------------------------- live

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from minipaged.model.testing import build_tiny_llama
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model"))


def live_args(model: str, *extra: str):
    from minipaged.cli import make_parser
    return make_parser().parse_args(["watch", "--model", model, "--workload", "chat", "--num-requests", "5",
                                     "--rate", "1", "--max-tokens", "12", "--num-blocks", "48",
                                     "--max-num-batched-tokens", "32", *extra])


@run_async
async def test_live_n_runs_exactly_one_engine_step_and_replay_matches(tiny_model, tmp_path):
    from minipaged.tui import build_live_run

    trace = tmp_path / "run.jsonl"
    live = build_live_run(live_args(tiny_model, "--record", str(trace)))
    engine_steps: list[int] = []
    app = WatchApp(live=live, paused=True)
    pictures = {}
    async with app.run_test(size=(160, 50)) as pilot:
        await wait_for(pilot, lambda: app.state is not None)
        live.engine.subscribe(lambda ev: engine_steps.append(ev.step))
        for k in range(1, 9):
            await pilot.press("n")
            await wait_for(pilot, lambda: not app.engine_busy)
            assert engine_steps == list(range(1, k + 1))         # one key, one engine step
            assert app.position == k and live.steps == k
            await pilot.pause()
            pictures[k] = map_picture(app)
        await pilot.pause(0.3)
        assert live.steps == 8                                   # paused: the engine waits
        await pilot.press("b")
        assert app.position == 7 and live.steps == 8             # stepping back needs no engine
        assert map_picture(app) == pictures[7]
        await pilot.press("q")
    info, events = read_trace(str(trace))
    assert len(events) == 8 and info == live.info

    replay = WatchApp(replay=(info, events), paused=True)
    async with replay.run_test(size=(160, 50)) as pilot:
        for k in range(1, 9):
            await pilot.press("n")
            await pilot.pause()
            assert map_picture(replay) == pictures[k], f"replay differs from the live run at step {k}"


@run_async
async def test_live_runs_to_the_end_while_the_ui_stays_responsive(tiny_model):
    from minipaged.tui import build_live_run

    live = build_live_run(live_args(tiny_model))
    app = WatchApp(live=live, speed=0.0, paused=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.engine_done)
        assert app.state.queues()["finished"] and not app.state.queues()["running"]
        assert all(not owners for owners in app.state.view.block_owners)   # every block came back
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape", "q")


@run_async
async def test_a_pool_of_8192_blocks_is_grouped_to_fit():
    from minipaged.events import EngineInfo, KVChanges, RequestArrival, ScheduledRequest, StepEvent

    info = EngineInfo(model="synthetic", num_blocks=8192, num_cpu_blocks=0, block_size=16, max_num_seqs=8,
                      max_num_batched_tokens=2048, max_model_len=8192, enable_chunked_prefill=True,
                      enable_prefix_caching=True, policy="continuous", preemption_mode="recompute",
                      kv_bytes_per_token=64, device="cpu", dtype="float32", attention_backend="torch")
    event = StepEvent(step=1, time_s=0.1, duration_s=0.1, schedule_s=0.0, model_s=0.1, budget_limit=2048,
                      budget_used=2048, max_num_seqs=8, arrivals=(RequestArrival("big", 32768, 1, "long"),),
                      scheduled=(ScheduledRequest("big", "prefill", 0, 2048, 32768, 0, 0),),
                      kv=KVChanges(allocated={"big": list(range(0, 6000, 3))}), running=("big",),
                      num_total_blocks=8192, num_free_blocks=8192 - 2000)
    app = WatchApp(replay=(info, [event]), paused=True)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("n")
        block_map = app.query_one("#gpu-map", BlockMap)
        group = block_map.grid.group
        assert group > 1 and f"1 cell = {group} blocks" in str(block_map.border_subtitle)
        assert len(block_map.cells) * group >= 8192
        assert sum(c.used for c in block_map.cells) == 2000
        assert any(c.used < c.size for c in block_map.cells if c.owner)      # partly used cells drawn partly
        lines = [block_map.render_line(y) for y in range(block_map.content_size.height)]
        assert all(line.cell_length == block_map.content_size.width for line in lines)


@run_async
async def test_side_panel_and_step_listeners_for_lessons():
    from textual.widgets import Static

    app = replay_app()
    seen: list[int] = []
    app.step_listeners.append(lambda event, state: seen.append(event.step))
    async with app.run_test(size=(160, 50)) as pilot:
        assert not app.query_one("#side").display
        app.set_side_panel(Static("Lesson 1: paged attention", id="lesson-text"))
        await pilot.pause()
        assert app.query_one("#side").display and app.query_one("#lesson-text")
        await pilot.press("n", "n")
        assert seen == [1, 2]


@run_async
async def test_prompts_with_a_shared_start_show_their_distinct_ends():
    """The request table shortens a long preview in its middle to the room its column has, so the ends of
    prompts behind one system prompt stay readable (the table itself would cut the end off)."""
    from dataclasses import replace

    from minipaged.events import KVChanges, RequestArrival
    from minipaged.tui.widgets.queues import RequestTable

    info, events = read_trace(str(TRACE))
    system = "You are a patient teaching assistant at a workshop about how computers work. " * 2
    questions = ["Why does bread rise?", "What is a prime number?", "How do vaccines work?"]
    ids = tuple(f"q{i}" for i in range(len(questions)))
    first = replace(events[0], arrivals=tuple(RequestArrival(rid, 40, 8, system + q) for rid, q in zip(ids, questions)),
                    scheduled=(), kv=KVChanges(), new_token_ids={}, new_text={}, running=(), waiting=ids,
                    num_free_blocks=info.num_blocks)
    app = WatchApp(replay=(info, [first]), paused=True)
    async with app.run_test(size=(160, 48)) as pilot:
        app.go_to(1)
        await pilot.pause()
        table = app.query_one(RequestTable)
        prompts = [str(table.get_row(f"q{i}")[-1]) for i in range(len(questions))]
        assert [p.endswith(q) for p, q in zip(prompts, questions)] == [True] * len(questions)
        assert all(p.startswith("You are") and "…" in p for p in prompts)
        await pilot.pause(0.1)
        assert sum(c.get_render_width(table) for c in table.columns.values()) <= table.content_size.width


class GatedEngine:
    """An engine whose every step waits until the test opens the gate: a step "in flight" on demand."""

    def __init__(self, info) -> None:
        import threading
        self.info, self.tokenizer, self.steps = info, None, 0
        self.gate = threading.Semaphore(0)

    def validate_request(self, prompt, params) -> None:
        pass

    def add_request(self, prompt, params, request_id=None):
        return request_id

    def has_unfinished_requests(self) -> bool:
        return True

    def step(self):
        from minipaged.events import StepEvent
        from minipaged.outputs import StepResult
        assert self.gate.acquire(timeout=30), "the test never let the step finish"
        self.steps += 1
        return StepResult((), StepEvent(step=self.steps, time_s=float(self.steps), duration_s=1.0, schedule_s=0.0,
                                        model_s=1.0, budget_limit=64, budget_used=0, max_num_seqs=8))


@run_async
async def test_a_running_step_is_shown_and_presses_meanwhile_are_queued_not_lost():
    info, _events = read_trace(str(TRACE))
    engine = GatedEngine(info)
    app = WatchApp(live=LiveRun(lambda progress: engine, Workload("t", "", ())), paused=True)
    async with app.run_test(size=(200, 40)) as pilot:
        await wait_for(pilot, lambda: app.state is not None)
        for _ in range(5):                                   # five presses while step 1 is still computing
            await pilot.press("n")
        await pilot.pause(0.3)
        header = app._topbar().plain
        assert "step 1 running" in header and "4 queued" in header
        for _ in range(5):
            engine.gate.release()
        await wait_for(pilot, lambda: app.position == 5 and not app.engine_busy)
        assert engine.steps == 5 and app.queued_steps == 0   # five presses, five steps
        assert "⏳" not in app._topbar().plain


@run_async
async def test_the_header_shows_the_achieved_rate_when_the_engine_falls_short():
    info, _events = read_trace(str(TRACE))
    engine = GatedEngine(info)
    app = WatchApp(live=LiveRun(lambda progress: engine, Workload("t", "", ())), paused=False, speed=15)
    async with app.run_test(size=(200, 40)) as pilot:
        await wait_for(pilot, lambda: app.state is not None)
        for _ in range(4):                                   # about 2 steps/s against 15 asked for
            engine.gate.release()
            await pilot.pause(0.5)
        await wait_for(pilot, lambda: app.position >= 4)
        header = app._topbar().plain
        assert "▶ 15 steps/s (achieved " in header
        achieved = app.achieved_rate()
        assert achieved is not None and achieved < 4
        told = []
        app.notify = lambda message, **kw: told.append(message)
        await pilot.press("space")                           # paused: + gives feedback, not silence
        await pilot.press("plus")
        await pilot.pause(0.2)
        assert app.paused and app.speed == 30.0
        assert told == ["speed 30 steps/s (paused: space runs)"]
        engine.gate.release()                                # let the step in flight end, so quitting is quick


@run_async
async def test_speculation_shows_each_drafts_verdict_and_the_acceptance_gauges(tiny_model, tmp_path):
    """The batch panel draws each verified decode's drafts (accepted / rejected) and the target's token; the
    gauges show acceptance; a recorded trace replays the same strips."""
    from minipaged.tui import build_live_run
    from minipaged.tui.widgets.batch import ACCEPTED, BONUS, BatchPanel, RECOVERED, REJECTED
    from minipaged.tui.widgets.gauges import Gauges

    trace = tmp_path / "spec.jsonl"
    live = build_live_run(live_args(tiny_model, "--record", str(trace), "--speculative-model", "self",
                                    "--num-draft-layers", "1", "--num-speculative-tokens", "3"))
    app = WatchApp(live=live, paused=True)
    seen: set[str] = set()
    async with app.run_test(size=(160, 50)) as pilot:
        await wait_for(pilot, lambda: app.state is not None)
        assert "speculative self-draft 1 layers k=3" in app._topbar().plain
        for _ in range(12):
            await pilot.press("n")
            await wait_for(pilot, lambda: not app.engine_busy)
            await pilot.pause()
            drawn = app.query_one(BatchPanel).render()
            seen |= {str(span.style) for span in drawn.spans}
            if {s.draft_token_ids != () for s in app.state.last_event.scheduled} == {True}:
                assert "decode 1+" in drawn.plain
        assert {ACCEPTED, REJECTED} <= seen and (BONUS in seen or RECOVERED in seen)
        gauges = app.query_one(Gauges)
        assert gauges.query_one("#gauge-accept").display and "%" in str(gauges.query_one("#gauge-accept").render())
        log = [line.text for line in app.state.log if line.kind == "spec"]
        assert log and "accepted" in log[0]
        await pilot.press("q")
    info, events = read_trace(str(trace))
    assert info.speculative == "self-draft 1 layers k=3"
    assert any(s.draft_token_ids and s.draft_pieces for ev in events for s in ev.scheduled)


def panel_lines(widget) -> list[str]:
    """A panel's content lines exactly as drawn on screen."""
    return ["".join(seg.text for seg in widget.render_line(y)).rstrip() for y in range(widget.content_size.height)]


@run_async
async def test_at_100x30_the_batch_panel_says_how_many_requests_it_cannot_list(tiny_model):
    """24 decodes in a 5-row panel (6 before the gauges got their "busy" row, issue 37): two are listed and
    "+22 more" says the rest exist (issue 16, defect 9: the line of totals wrapped and pushed the "more" row out)."""
    from minipaged import Engine
    from minipaged.tui.widgets.batch import BatchPanel
    from minipaged.workloads import make_workload

    workload = make_workload("burst")
    run = LiveRun(lambda progress: Engine(tiny_model, num_blocks=512), workload)
    info = run.load()
    events = []
    while (event := run.step()) is not None:
        events.append(event)
    step = next(i for i, e in enumerate(events, 1) if e.num_decode_tokens == 24)
    app = WatchApp(replay=(info, events), paused=True)
    async with app.run_test(size=(100, 30)) as pilot:
        app.go_to(step)
        await pilot.pause()
        lines = panel_lines(app.query_one("#batch", BatchPanel))
        assert len(lines) == 5 and lines[-1] == "+22 more", lines
        assert sum(line.startswith("██ ") and " decode " in line for line in lines) == 2
        assert lines[1].startswith("seqs 24/256") and lines[2].startswith("██ ")
        await pilot.press("q")


@run_async
async def test_on_a_cpu_the_pools_are_named_for_the_memory_they_live_in():
    """The class's laptops have no GPU: the KV pool says "CPU memory" and the swap pool is the host pool."""
    from minipaged.tui.widgets.block_map import pool_name

    assert pool_name("cuda:0") == "GPU KV blocks" and pool_name("cpu") == "KV blocks (CPU memory)"
    info, events = read_trace(str(TRACE))
    assert info.device == "cpu" and info.num_cpu_blocks
    app = WatchApp(replay=(info, events), paused=True)
    async with app.run_test(size=(160, 50)) as pilot:
        app.go_to(len(events))
        await pilot.pause()
        assert app.query_one("#gpu-map", BlockMap).border_title.startswith("KV blocks (CPU memory): ")
        assert app.query_one("#cpu-map", BlockMap).border_title.startswith("host pool (swap): ")
        await pilot.press("q")


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@run_async
async def test_s_saves_the_screen_as_svg_and_png_in_the_pictures_folder_not_the_working_one(tmp_path, monkeypatch):
    work = tmp_path / "work"                      # a checkout, say: the pictures must not land in the repository
    work.mkdir()
    monkeypatch.chdir(work)
    tmp_path = tmp_path / "pictures"
    monkeypatch.setenv("MINIPAGED_PICTURES", str(tmp_path))
    app = replay_app()
    notes: list[str] = []
    app.notify = lambda message, **kwargs: notes.append(message)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("n", "n", "s", "s")
        await pilot.press("q")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["minipaged-replay-step2-2.png", "minipaged-replay-step2-2.svg",
                     "minipaged-replay-step2.png", "minipaged-replay-step2.svg"]
    svg = (tmp_path / "minipaged-replay-step2.svg").read_text()
    assert svg.lstrip().startswith("<svg") and "step&#160;2/" in svg
    width, height = png_size((tmp_path / "minipaged-replay-step2.png").read_bytes())
    assert width > 1000 and height > 500
    assert any("minipaged-replay-step2.svg, minipaged-replay-step2.png in " + str(tmp_path) in n for n in notes)
    assert not list(work.iterdir())


def test_the_png_has_text_drawn_not_only_boxes():
    """Without a font resvg knows, the PNG shows coloured boxes and no text: the same screen with its text
    made invisible must differ from it."""
    from minipaged.tui.pictures import svg_to_png
    from minipaged.tui.screenshots import render

    svg = asyncio.run(render(str(TRACE), 2, None, (80, 24)))
    no_text = svg.replace("<text ", '<text visibility="hidden" ')
    assert svg_to_png(svg) != svg_to_png(no_text)
