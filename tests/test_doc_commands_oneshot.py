"""Every one-shot ``minipaged ...`` command the guides quote (generate, lessons, lab, notebooks, serve --help)
runs to its end in this process through ``minipaged.cli.main(argv)``, as typed (tests/doc_commands.py: what is
substituted, what is skipped and why), and exits 0 or does what its guide promises (``lab check N`` on the
untouched stub: exit 1, every check "not written yet"). The embedded SmolLM2 is loaded once for them all.

The commands that need a recorded trace (plot, export-html) run in test_doc_commands_watch.py after the
README's ``watch --record``; the parallel ones (-tp/-pp, which start worker processes) and the servers and their
clients in test_doc_commands_serve.py.
"""
from __future__ import annotations

import shlex

import pytest

from doc_commands import (ALL, expected_end, of_kind, one_load_per_model, parsed, run_main,
                          student_folder)

NEEDS_A_TRACE = ("plot", "export-html")


pytestmark = pytest.mark.slow         # they load the embedded SmolLM2 (once per process)

@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch, one_load_per_model(monkeypatch):
        yield student_folder(tmp_path_factory.mktemp("student"))


@pytest.mark.parametrize("command", of_kind("oneshot", where=lambda c: c.argv[0] not in NEEDS_A_TRACE))
def test_one_shot_commands_finish(command, workdir):
    if command.argv[:2] == ["lab", "check"]:
        code, output = run_main(["lab", "start", command.argv[2]], workdir)   # the guide's step before it
        assert code == 0, output
    code, output = run_main(command.argv, workdir)
    expected_end(command, code, output)


FLEETS = [c for c in ALL if c.argv[0] == "fleet" and "--serve-args" in c.argv]


@pytest.mark.parametrize("command", [pytest.param(c, id=c.text) for c in FLEETS])
def test_the_fleets_serve_args_are_serve_flags(command):
    """``fleet --serve-args "..."`` hands its string to each replica's ``minipaged serve``: a wrong flag there
    would stop every replica at its start, and no parser sees it before. (The fleets themselves start two
    SmolLM2 replicas each: test_doc_commands_serve.py says which ones run.)"""
    serve_args = shlex.split(command.argv[command.argv.index("--serve-args") + 1])
    assert serve_args and parsed(["serve", *serve_args]) is not None, command


def test_every_kind_of_command_is_run_somewhere():
    """Each distinct command is one of the kinds the doc-command files run (none falls between them)."""
    kinds = {c.kind for c in ALL}
    assert kinds <= {"oneshot", "tui", "parallel", "server", "client", "client-tui"}, kinds
    assert len(ALL) > 60
