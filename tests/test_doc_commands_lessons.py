"""Every ``minipaged watch --lesson N ...`` the lessons and docs quote opens the lesson's app in this process,
loads its engine, runs its first steps and quits on q with exit 0 and no thread left (tests/doc_commands.py:
how the app is driven, what is substituted and skipped). The lessons' variants differ only in engine options:
the embedded SmolLM2 is loaded once for them all. (Lesson 7's run parallel engines, whose workers are
processes: test_doc_commands_serve.py runs it.)"""
from __future__ import annotations

import pytest

from doc_commands import of_kind, one_load_per_model, run_watch_command, student_folder


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch, one_load_per_model(monkeypatch):
        yield student_folder(tmp_path_factory.mktemp("student"))


@pytest.mark.parametrize("command", of_kind("tui", where=lambda c: "--lesson" in c.argv))
def test_lesson_apps_draw_step_and_quit(command, workdir, monkeypatch):
    run_watch_command(command, workdir, monkeypatch)
