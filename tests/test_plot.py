"""`minipaged plot TRACE.jsonl` and the TUI's `p` key: a picture of a recorded run, built from its events."""
from __future__ import annotations

import subprocess
import sys

import pytest

from minipaged.cli import main
from minipaged.plot import STATE_COLOURS, STATES, TOKEN_KINDS, build_timeline, draw_run
from minipaged.request import SamplingParams
from minipaged.trace import read_trace, write_trace_event, write_trace_header
from pilot_util import run_async, wait_for
from test_bench import png_size


@pytest.fixture(scope="module")
def trace(tiny_engine_factory, tmp_path_factory):
    """A run with everything a request can go through: a shared prefix (cache hits), chunked prefill under
    a small budget, and a pool too small for all of them (preemption by swapping)."""
    engine = tiny_engine_factory(num_blocks=24, block_size=4, max_num_batched_tokens=24,
                                 preemption_mode="swap", num_cpu_blocks=64)
    path = tmp_path_factory.mktemp("plot") / "run.jsonl"
    shared = list(range(3, 19))
    prompts = [shared + [40 + i] * (4 + 3 * i) for i in range(6)]
    with open(path, "w") as fp:
        write_trace_header(fp, engine.info)
        engine.subscribe(lambda e: write_trace_event(fp, e))
        engine.generate(prompts, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    return path


def test_timeline_follows_what_the_engine_did(trace):
    info, events = read_trace(str(trace))
    timeline = build_timeline(info, events)
    assert any(ev.preempted for ev in events) and any(ev.swapped for ev in events)   # the run shows them
    assert len(timeline.request_ids) == 6 and timeline.steps == [ev.step for ev in events]
    arrived = {a.request_id: ev.step for ev in events for a in ev.arrivals}
    finished = {f.request_id: ev.step for ev in events for f in ev.finished}
    for rid in timeline.request_ids:
        row = timeline.states[rid]
        present = [step for step, state in zip(timeline.steps, row) if state is not None]
        assert present == list(range(arrived[rid], finished[rid] + 1))     # from arrival to finish, no gap
        assert timeline.state_at(rid, finished[rid]) == "finished"
    for ev in events:
        preempted = {p.request_id for p in ev.preempted}
        for p in preempted:
            assert timeline.state_at(p, ev.step) == "preempted"
        for s in ev.scheduled:
            if s.request_id not in preempted and s.request_id not in {f.request_id for f in ev.finished}:
                assert timeline.state_at(s.request_id, ev.step) == s.kind
        for rid in ev.swapped:
            if rid not in preempted:
                assert timeline.state_at(rid, ev.step) == "swapped"
    assert {s for row in timeline.states.values() for s in row} >= {"waiting", "prefill", "decode", "preempted",
                                                                     "swapped", "finished"}
    budget_used = [ev.budget_used for ev in events]
    assert [p + d for p, d in zip(timeline.prefill_tokens, timeline.decode_tokens)] == budget_used
    assert max(budget_used) <= info.max_num_batched_tokens and set(timeline.budget) == {24}
    assert max(timeline.blocks_used) <= info.num_blocks and timeline.blocks_used[-1] == 0
    assert max(timeline.blocks_cached_free) > 0                   # finished prompts left their prefix cached


def test_speculative_steps_show_their_drafts_accepted_and_rejected(tiny_engine_factory, tmp_path):
    """With speculative decoding a decode row carries drafts: the tokens panel splits each step's budget into
    prefill, each decode's own token, drafts the target kept and drafts it threw away (colours drawn)."""
    engine = tiny_engine_factory(speculative_config={"method": "draft_model", "model": "self",
                                                     "num_draft_layers": 1, "num_speculative_tokens": 3})
    events = []
    engine.subscribe(events.append)
    engine.generate([[5, 6, 7, 8] * 3, list(range(30, 45)), [9] * 10],
                    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    timeline = build_timeline(engine.info, events)
    stats = engine.stats()
    assert sum(timeline.accepted_draft_tokens) == stats["spec_decode_num_accepted_tokens"] > 0
    assert sum(timeline.accepted_draft_tokens) + sum(timeline.rejected_draft_tokens) \
        == stats["spec_decode_num_draft_tokens"] > sum(timeline.accepted_draft_tokens)      # some rejected too
    for i, ev in enumerate(events):
        parts = [getattr(timeline, series)[i] for series, _, _ in TOKEN_KINDS]
        assert sum(parts) == ev.budget_used                                 # the bars add up to the budget used
        assert timeline.decode_tokens[i] == sum(s.kind == "decode" for s in ev.scheduled)   # one own token each
    picture = draw_run(engine.info, events, tmp_path / "spec.png", size=(1200, 800))
    import matplotlib.image
    pixels = (matplotlib.image.imread(picture)[..., :3] * 255).round().astype(int)
    colours = {tuple(int(c) for c in row) for row in pixels[625:740, 100:1000].reshape(-1, 3)}   # tokens panel
    for series, hex_colour, _ in TOKEN_KINDS[1:]:       # visible: the 2048-token budget does not flatten them
        assert tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)) in colours, f"no {series} bar drawn"


def test_plot_command_draws_the_run_at_the_size_asked(trace, tmp_path, capsys):
    picture = tmp_path / "run.png"
    assert main(["plot", str(trace), "-o", str(picture), "--size", "1200x800"]) == 0
    assert png_size(picture) == (1200, 800)
    assert "wrote" in capsys.readouterr().out
    import matplotlib.image
    pixels = (matplotlib.image.imread(picture)[..., :3] * 255).round().astype(int)
    requests_panel = pixels[100:400, 120:960]                         # inside the top panel, left of the legend
    colours = {tuple(int(c) for c in row) for row in requests_panel.reshape(-1, 3)}
    for state in ("prefill", "decode", "preempted", "swapped"):      # every state the run had is drawn
        hex_colour = STATE_COLOURS[STATES.index(state)]
        rgb = tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))
        assert rgb in colours, f"no {state} cell in the picture"


@pytest.mark.parametrize("content,args,message", [
    (None, [], "no such file"),
    ("hello\n", [], "not a minipaged trace line"),
    ('{"type": "engine"}\n', [], "not a minipaged trace line"),
    ("", [], "no engine header"),
    ("header-only", [], "no steps yet"),
    ("header-only", ["-o", "run.jpg"], "ending in .png"),
    ("header-only", ["--size", "big"], "WIDTHxHEIGHT"),
])
def test_bad_input_is_one_clear_line_and_exit_2(trace, tmp_path, capsys, content, args, message):
    path = tmp_path / "t.jsonl"
    if content == "header-only":
        path.write_text(trace.read_text().splitlines()[0] + "\n")
    elif content is not None:
        path.write_text(content)
    assert main(["plot", str(path), "-o", str(tmp_path / "x.png"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_missing_matplotlib_is_one_clear_line(trace, tmp_path, capsys, monkeypatch):
    """matplotlib is not a core dependency: without it, `minipaged plot` says how to get it and exits 2."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)       # import matplotlib now raises ImportError
    assert main(["plot", str(trace), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "pip install matplotlib" in err and "Traceback" not in err and err.count("\n") == 1
    assert not (tmp_path / "x.png").exists()


def test_plot_needs_neither_torch_nor_transformers(trace, tmp_path):
    """Thin clients (watch --attach) draw with the same module, so it must stay light."""
    picture = tmp_path / "light.png"
    code = (f"import sys\nfrom minipaged.cli import main\nassert main(['plot', {str(trace)!r}, '-o', "
            f"{str(picture)!r}]) == 0\nprint(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]" and png_size(picture) == (1600, 1000)


@run_async
async def test_p_key_saves_a_plot_of_the_steps_on_screen_in_the_pictures_folder(trace, tmp_path, monkeypatch):
    from minipaged.tui.app import WatchApp

    work, pictures = tmp_path / "work", tmp_path / "pictures"
    work.mkdir()
    monkeypatch.chdir(work)                                     # e.g. the repository: nothing lands here
    monkeypatch.setenv("MINIPAGED_PICTURES", str(pictures))
    tmp_path = pictures
    info, events = read_trace(str(trace))
    app = WatchApp(replay=(info, events), paused=True)
    async with app.run_test(size=(160, 50)) as pilot:
        await pilot.press("p")                                  # step 0: nothing to draw yet
        await pilot.pause()
        assert not list(tmp_path.glob("*.png"))
        for _ in range(5):
            await pilot.press("n")
        await pilot.press("p")
        await wait_for(pilot, lambda: list(tmp_path.glob("minipaged-run-*.png")), timeout=60)
        await app.workers.wait_for_complete()
        await pilot.pause()
        messages = [n.message for n in app._notifications]
        assert any("steps 1-5" in m for m in messages) and any("no steps yet" in m for m in messages)
    picture, = tmp_path.glob("minipaged-run-*.png")
    assert png_size(picture) == (1600, 1000)
    assert not list(work.iterdir())
