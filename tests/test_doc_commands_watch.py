"""Every other ``minipaged watch ...`` the README, docs and labs quote (workloads, --record/--replay, --compare,
the student's policy, the labs) opens its app in this process, loads its engine, runs its first step and quits
on q with exit 0 and no thread left; then the commands that read the README's recorded run (plot, export-html)
finish. tests/doc_commands.py: how the app is driven, what is substituted and skipped. The embedded SmolLM2 is
loaded once for them all."""
from __future__ import annotations

import functools

import pytest

from doc_commands import (ALL, expected_end, first_steps, lab_folder, of_kind, one_load_per_model, run_main,
                          run_watch_command, student_folder)

RECORD = ["watch", "--record", "run.jsonl"]
RECORDED_STEPS = 3       # steps the recording app is watched through before q (it may record more: never fewer)


pytestmark = pytest.mark.slow         # they load the embedded SmolLM2 (once per process)

@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch, one_load_per_model(monkeypatch):
        yield student_folder(tmp_path_factory.mktemp("student")), lab_folder(tmp_path_factory.mktemp("labs"))


@pytest.fixture(scope="module")
def recorded_trace(folders):
    """The README's ``minipaged watch --record run.jsonl``: the trace that replay, plot and export-html read."""
    (command,) = [c for c in ALL if c.argv == RECORD]
    with pytest.MonkeyPatch.context() as monkeypatch:        # several steps, for replay and plot to go through
        run_watch_command(command, folders[0], monkeypatch, functools.partial(first_steps, steps=RECORDED_STEPS))
    trace = folders[0] / "run.jsonl"
    lines = trace.read_text().splitlines()                   # the engine's header, then a line per step
    assert len(lines) >= 1 + RECORDED_STEPS, f"{command} wrote {len(lines) - 1} steps to run.jsonl, not the " \
        f"{RECORDED_STEPS} the app showed"
    return trace


@pytest.mark.parametrize("command", of_kind("tui", where=lambda c: "--lesson" not in c.argv))
def test_watch_apps_draw_step_and_quit(command, folders, recorded_trace, monkeypatch):
    if command.argv != RECORD:                    # (recorded_trace ran that one, and checked its trace)
        run_watch_command(command, folders[1] if "--lab" in command.argv else folders[0], monkeypatch)


@pytest.mark.parametrize("command", of_kind("oneshot", where=lambda c: c.argv[0] in ("plot", "export-html")))
def test_commands_that_read_the_recorded_run_finish(command, folders, recorded_trace):
    code, output = run_main(command.argv, folders[0])
    expected_end(command, code, output)
    written = command.argv[command.argv.index("-o") + 1] if "-o" in command.argv else None
    if written:
        assert (folders[0] / written).stat().st_size > 0, f"{command} wrote nothing to {written}"
