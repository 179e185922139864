"""Every ``minipaged watch --lesson N ...`` the lessons and docs quote opens the lesson's app in this process,
loads its engine, runs its first step and quits on q with exit 0 and no thread left (tests/doc_commands.py:
how the app is driven, what is substituted and skipped; lesson 12's first step is not waited for, STEPS_NOT_WAITED
says why). The lessons' variants differ only in engine options: the embedded SmolLM2 is loaded once for them all
(``watch --lesson 7`` opens the lesson's one-process run; its tp3 and pp2 runs are other commands)."""
from __future__ import annotations

import pytest

from doc_commands import of_kind, one_load_per_model, run_watch_command, student_folder


pytestmark = pytest.mark.slow         # they load the embedded SmolLM2 (once per process)

@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch, one_load_per_model(monkeypatch):
        yield student_folder(tmp_path_factory.mktemp("student"))


@pytest.mark.parametrize("command", of_kind("tui", where=lambda c: "--lesson" in c.argv))
def test_lesson_apps_draw_step_and_quit(command, workdir, monkeypatch):
    run_watch_command(command, workdir, monkeypatch)
