"""``make test``'s first phase runs the files in conftest.TOGETHER two at a time: none of them may start a
process, a server, a browser or a terminal, or bound a time, or it would race its neighbour on the other core
(tests/conftest.py says why the suite has two phases)."""
from __future__ import annotations

import re
from pathlib import Path

from conftest import TOGETHER

TESTS = Path(__file__).resolve().parent
# What a file that starts something, or times something, says.
STARTS_OR_TIMES = re.compile(r"\b(subprocess|Popen|serve_util|browser_util|pilot_util|chromium|tmux|torchrun|"
                             r"multiprocessing|uvicorn|NotebookClient|run_test|perf_counter|monotonic)\b")


def test_every_file_of_the_first_phase_exists():
    assert TOGETHER <= {p.stem for p in TESTS.glob("test_*.py")}


def test_no_file_of_the_first_phase_starts_a_process_or_bounds_a_time():
    found = {name: sorted(set(STARTS_OR_TIMES.findall((TESTS / f"{name}.py").read_text())))
             for name in sorted(TOGETHER - {"test_suite_phases"})}
    assert not {name: words for name, words in found.items() if words}


def test_the_makefile_runs_both_phases():
    recipe = (TESTS.parent / "Makefile").read_text().split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "-m together -n 2 --dist loadfile" in recipe and '-m "not together"' in recipe
