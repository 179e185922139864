"""minipaged.notebook: the widget's feed (rate bound, coalescing, late views), its ES module (the page's own fold
and drawing modules, not a copy), the thin client without torch, and the lessons as notebooks.

CI generates every lesson's notebook, validates it with nbformat, and executes all of them with nbclient in one
real ipykernel on a tiny model, checking every checkpoint ticks. tests/test_notebook_lab.py draws the widget in
JupyterLab.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from minipaged import SamplingParams
from minipaged.event_view import EngineView
from minipaged.events import StepEvent
from minipaged.notebook.bundle import PAGE_MODULES, widget_esm
from minipaged.notebook.feed import EventFeed, ReplayFeed
from minipaged.trace import write_trace_event, write_trace_header

ROOT = Path(__file__).resolve().parent.parent
STATIC = ROOT / "minipaged" / "web" / "static"


@pytest.fixture(scope="module")
def recorded(tiny_engine_factory):
    """A run with prefix hits, chunks and preemptions: (info, events)."""
    engine = tiny_engine_factory(num_blocks=24, max_num_batched_tokens=16)
    events: list[StepEvent] = []
    engine.subscribe(events.append)
    prompts = [[7] * 20 + [i] * (3 + i) for i in range(8)]
    engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert len(events) > 25
    return engine.info, events


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def steps_in(messages):
    return [ev for m in messages if m["kind"] == "steps" for ev in json.loads(m["json"])]


def test_the_feed_sends_every_step_in_order_at_a_bounded_rate(recorded):
    info, events = recorded
    sent, clock = [], Clock()
    feed = EventFeed(sent.append, info, max_rate_hz=10, max_steps_per_message=1000, clock=clock)
    for ev in events:                      # a step every 5 ms: 200 steps a second
        feed.push(ev)
        feed.flush()
        clock.t += 0.005
    feed.flush(force=True)
    elapsed = clock.t
    assert len(sent) <= elapsed * 10 + 2, (len(sent), elapsed)      # ten messages a second, not two hundred
    assert [ev["step"] for ev in steps_in(sent)] == [ev.step for ev in events]
    assert feed.steps_sent == len(events) and feed.view.step == events[-1].step


def test_a_long_burst_is_coalesced_into_one_exact_snapshot(recorded):
    info, events = recorded
    sent = []
    feed = EventFeed(sent.append, info, max_steps_per_message=10, clock=Clock())
    for ev in events:
        feed.push(ev)
    feed.flush(force=True)
    assert [m["kind"] for m in sent] == ["snapshot"] and sent[0]["skipped"] == len(events)
    # The snapshot, folded into an empty view, draws what every step did: the same blocks and requests.
    whole, late = EngineView(info), EngineView(info)
    for ev in events:
        whole.apply(ev)
    late.apply(StepEvent.from_dict(json.loads(sent[0]["json"])))
    assert late.block_owners == whole.block_owners and late.step == whole.step
    live = {rid: (r.state, r.blocks) for rid, r in whole.requests.items() if r.state != "finished"}
    assert {rid: (r.state, r.blocks) for rid, r in late.requests.items()} == live


def test_a_view_that_opens_late_gets_a_reset_and_the_state_now_for_itself_alone(recorded):
    info, events = recorded
    sent = []
    feed = EventFeed(sent.append, info, clock=Clock())
    for ev in events[:10]:
        feed.push(ev)
    feed.hello("view-2")
    assert [m["kind"] for m in sent] == ["steps", "reset", "snapshot"]
    assert sent[1]["for"] == sent[2]["for"] == "view-2" and "for" not in sent[0]
    assert json.loads(sent[2]["json"])["step"] == events[9].step


def test_replay_sends_a_trace_in_chunks_and_keeps_every_step(recorded, tmp_path):
    info, events = recorded
    path = tmp_path / "run.jsonl"
    with open(path, "w", encoding="utf-8") as fp:
        write_trace_header(fp, info)
        for ev in events:
            write_trace_event(fp, ev)
    sent = []
    feed = ReplayFeed.from_file(sent.append, str(path))
    feed.hello("v")
    assert sent[0]["kind"] == "reset" and sent[0]["keep"] == len(events) and sent[0]["replay"]
    assert [ev["step"] for ev in steps_in(sent)] == [ev.step for ev in events]


def test_watch_follows_a_running_engine_through_its_flusher_thread(tiny_engine_factory):
    from minipaged.notebook import watch

    engine = tiny_engine_factory()
    widget = watch(engine, keep=50, max_rate_hz=20)
    sent = []
    widget.source.send = sent.append
    engine.generate([[3] * 12, [4] * 9], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    deadline = time.monotonic() + 5
    while widget.source._pending and time.monotonic() < deadline:      # the flusher sends the rest by itself
        time.sleep(0.05)
    assert not widget.source._pending
    assert widget.step == steps_in(sent)[-1]["step"] and widget.keep == 50
    widget.stop()
    n = widget.step
    engine.generate([[5] * 6], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert widget.step == n                                            # stopped: no longer subscribed


def test_the_widget_module_is_the_pages_modules_not_a_copy():
    esm = widget_esm()
    for name in PAGE_MODULES:                  # each page module's body is in the bundle, as the page has it
        body = (STATIC / name).read_text(encoding="utf-8")
        first_function = re.search(r"^(?:export )?function (\w+)\(", body, re.M).group(1)
        assert f"function {first_function}(" in esm, name
    own = (ROOT / "minipaged" / "notebook" / "widget.mjs").read_text(encoding="utf-8")
    for fold_function in ("function applyEvent", "function newState", "function drawCells", "function drawTable"):
        assert fold_function not in own and esm.count(fold_function) == 1
    assert esm.rstrip().endswith("export default { render };")
    assert not [line for line in esm.splitlines() if line.startswith("import ")]   # one module, nothing to fetch


@pytest.mark.skipif(not __import__("shutil").which("node"), reason="node is not installed")
def test_the_widget_module_parses(tmp_path):
    path = tmp_path / "widget.mjs"
    path.write_text(widget_esm(), encoding="utf-8")
    done = subprocess.run(["node", "--check", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


ATTACH_WITHOUT_TORCH = """
import sys, time
for heavy in ("torch", "transformers", "triton"):
    sys.modules[heavy] = None           # every import of them raises ImportError
from minipaged.notebook import attach
w = attach(sys.argv[1], max_rate_hz=20)
deadline = time.monotonic() + 20
while w.step < int(sys.argv[2]) and time.monotonic() < deadline:
    time.sleep(0.05)
w.stop()
print("attached to step", w.step)
"""


def test_attach_reads_a_servers_event_stream_without_torch(recorded):
    info, events = recorded
    lines = [json.dumps({"type": "engine", **__import__("dataclasses").asdict(info)})] + [ev.to_json() for ev in events]
    body = ("".join(f"data: {line}\n\n" for line in lines) + ": heartbeat\n\n").encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):                                   # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
            time.sleep(3)                                   # a live stream: open, quiet

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        done = subprocess.run([sys.executable, "-c", ATTACH_WITHOUT_TORCH, f"http://127.0.0.1:{server.server_port}",
                               str(events[-1].step)], capture_output=True, text=True, timeout=90)
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"attached to step {events[-1].step}" in done.stdout


# ------------------------------------------------------------------------------------------ lessons as notebooks


def test_every_lesson_becomes_a_valid_notebook_from_its_own_data(tmp_path):
    import nbformat

    from minipaged.lessons.core import list_lessons
    from minipaged.notebook.lessons import LessonNotebook

    done = subprocess.run([sys.executable, "-m", "minipaged", "lessons", "--notebook", "all", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lessons = list_lessons()
    assert len(list(tmp_path.glob("*.ipynb"))) == len(lessons) == 12
    for lesson in lessons:
        nb = nbformat.read(str(tmp_path / f"{lesson.slug}.ipynb"), as_version=4)
        nbformat.validate(nb)
        code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
        text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
        for variant in LessonNotebook.variants_of(lesson):      # every run a checkpoint needs
            assert f"lesson.run({variant!r})" in code
        assert lesson.title in text and "lesson.checkpoints()" in code
        for q in lesson.render_quiz():
            assert q.question in text and q.explanation in text
        assert nb.metadata["minipaged"]["checkpoints"] == len(lesson.checkpoints)


# The first cell of each notebook in the shared kernel: the names the notebook before it defined are gone.
FORGET = ("for _name in [n for n in globals() if not n.startswith('_') and n not in ('In', 'Out', 'get_ipython', "
          "'exit', 'quit')]:\n    del globals()[_name]")


@pytest.fixture(scope="module")
def executed_notebooks(tmp_path_factory):
    """Every lesson's notebook as ``minipaged lessons --notebook`` makes it, executed headless by nbclient in a real
    ipykernel, with the model line edited as a teacher edits it (the lesson model: SmolLM2's shape, tiny weights,
    so lesson 7's split runs). One kernel runs them one after another, each notebook opened by a cell that deletes
    every name the one before defined (only imported modules stay loaded): one start-up of Python, torch and
    transformers for all twelve instead of twelve. (Not ``%reset -f``: it also deletes ``__main__.__spec__``, and
    lesson 7's worker processes then cannot start.) The fleet lesson (11) needs sglang-router, which CI installs.

    Returns {lesson number: (lesson, the executed notebook)}; the notebooks are also written to the tmp dir."""
    import nbformat
    from nbclient import NotebookClient
    from nbformat.v4 import new_code_cell

    from minipaged.lessons.core import build_lesson_model, list_lessons
    from minipaged.lessons.fleet import FleetScenario
    from minipaged.notebook.notebooks import MODEL_LINE, lesson_notebook

    folder = tmp_path_factory.mktemp("lesson-notebooks")
    model = build_lesson_model(str(folder / "model"))
    has_router = importlib.util.find_spec("sglang_router") is not None
    lessons = [lesson for lesson in list_lessons() if has_router or not isinstance(lesson.scenario, FleetScenario)]
    executed, first = {}, None
    os.environ["HF_HUB_OFFLINE"] = "1"                  # the kernel inherits it (conftest sets it for the suite)
    try:
        for lesson in lessons:
            nb = lesson_notebook(lesson)
            setup = next(c for c in nb.cells if c.cell_type == "code" and MODEL_LINE in c.source)
            setup.source = setup.source.replace(MODEL_LINE, f"MODEL = {model!r}")
            nb.cells.insert(0, new_code_cell(FORGET))
            client = NotebookClient(nb, timeout=180, kernel_name="python3",
                                    resources={"metadata": {"path": str(folder)}})
            if first is None:
                first = client
            else:                                       # the same kernel and its client
                client.km, client.kc = first.km, first.kc
            client.execute(cleanup_kc=False)
            nbformat.write(nb, str(folder / f"{lesson.slug}.ipynb"))
            executed[lesson.number] = (lesson, nb)
    finally:
        if first is not None and first.km is not None:
            first._cleanup_kernel()                     # the kernel process stops here, pass or fail
    return executed


def test_every_lesson_notebook_runs_headless_and_ticks_every_checkpoint(executed_notebooks):
    from minipaged.lessons.core import list_lessons

    wanted = {lesson.number for lesson in list_lessons()}
    if importlib.util.find_spec("sglang_router") is None:
        wanted -= {11}                                  # (the fleet lesson: pip install -e '.[fleet]')
    assert set(executed_notebooks) == wanted
    for number, (lesson, nb) in executed_notebooks.items():
        outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
        assert not [o for o in outputs if o.output_type == "error"], number
        text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
        n = len(lesson.checkpoints)
        assert f"checkpoints ticked: {n}/{n}" in text, (number, text)
        widgets = [o for o in outputs if o.output_type == "display_data"
                   and "application/vnd.jupyter.widget-view+json" in o.get("data", {})
                   and "EngineWidget" in o["data"].get("text/plain", "")]
        assert len(widgets) >= len(nb.metadata["minipaged"]["variants"]), number   # a live view (or more) per run


def test_a_notebook_forgets_the_names_of_the_one_before(executed_notebooks):
    """The shared kernel does not let one notebook lean on another's names: each begins by deleting them, so a
    notebook that used a name it never defined would fail here as it would alone (``lesson`` is defined by every
    notebook: a notebook that skipped its set-up cell would find none)."""
    for _lesson, nb in executed_notebooks.values():
        assert nb.cells[0].source == FORGET and nb.cells[0].get("outputs", []) == []
    from IPython.core.interactiveshell import InteractiveShell        # what the cell does, in a shell of our own
    shell = InteractiveShell.instance()
    shell.run_cell("lesson = 'from the notebook before'")
    shell.run_cell(FORGET)
    assert shell.run_cell("lesson").error_in_exec is not None


def test_record_writes_a_trace_that_replay_draws(tiny_engine_factory, tmp_path):
    from minipaged.notebook import record, replay
    from minipaged.trace import read_trace

    engine = tiny_engine_factory()
    stop = record(engine, str(tmp_path / "run.jsonl"))
    engine.generate([[3] * 10], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    stop()
    info, events = read_trace(str(tmp_path / "run.jsonl"))
    assert info == engine.info and events
    widget = replay(str(tmp_path / "run.jsonl"))
    sent = []
    widget.source.send = sent.append
    widget.source.hello("v")
    assert [ev["step"] for ev in steps_in(sent)] == [ev.step for ev in events] and widget.step == len(events)


def test_to_json_writes_what_asdict_wrote(recorded, tiny_engine_factory):
    """StepEvent.to_json skips asdict's deep copy (the widget's feed and the server serialise every step): the
    same JSON value on events with arrivals, chunks, preemptions, speculative drafts and log-probs, as compact
    (msgspec writes floats in their shortest form and leaves text UTF-8); a lone surrogate (a client's JSON can
    send one) still gets through."""
    from dataclasses import asdict

    _info, events = recorded
    engine = tiny_engine_factory(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                     "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    more: list[StepEvent] = []
    engine.subscribe(more.append)
    engine.generate([[5, 6, 7, 8] * 6], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2))
    assert any(s.draft_token_ids for ev in more for s in ev.scheduled) and any(ev.new_logprobs for ev in more)
    for ev in events + more:
        written, before = ev.to_json(), json.dumps({"type": "step", **asdict(ev)}, separators=(",", ":"))
        assert json.loads(written) == json.loads(before)
        assert "\n" not in written                              # one line of a JSON-lines trace
    odd = dataclasses.replace(events[-1], new_text={"r0": "\ud800 lone"})
    assert json.loads(odd.to_json())["new_text"] == {"r0": "\ud800 lone"}
