"""``make test``'s first phase runs the files in conftest.TOGETHER two at a time, and its second runs those in
conftest.ALONGSIDE beside the serial lane: none of them may start a process, a server, a browser or a terminal, or
measure a time, or it would race its neighbour on the other core (tests/conftest.py says why the suite has two
phases and two lanes). Textual's headless driver (``run_test``, ``App.run(headless=True)``) is allowed: it waits
for what an app shows, not for a time."""
from __future__ import annotations

import re
from pathlib import Path

from conftest import ALONGSIDE, TOGETHER

TESTS = Path(__file__).resolve().parent
# What a file that starts something, or times something, says.
STARTS_OR_TIMES = re.compile(r"\b(subprocess|Popen|serve_util|browser_util|chromium|tmux|torchrun|"
                             r"multiprocessing|uvicorn|NotebookClient|perf_counter|monotonic)\b")


def test_every_file_named_for_the_first_phase_or_the_alongside_lane_exists():
    assert TOGETHER | ALONGSIDE <= {p.stem for p in TESTS.glob("test_*.py")} and not TOGETHER & ALONGSIDE


def test_no_file_of_the_first_phase_or_the_alongside_lane_starts_a_process_or_bounds_a_time():
    found = {name: sorted(set(STARTS_OR_TIMES.findall((TESTS / f"{name}.py").read_text())))
             for name in sorted((TOGETHER | ALONGSIDE) - {"test_suite_phases"})}
    assert not {name: words for name, words in found.items() if words}


def test_the_tests_marked_alongside_are_the_smollm2_lessons_alone():
    """One test outside ALONGSIDE's files joins the lane by its marker: SmolLM2's lessons, a computation in
    worker processes that neither serve nor time anything (the longest test of the suite)."""
    marked = [path.stem for path in TESTS.glob("test_*.py") if "@pytest.mark.alongside" in path.read_text()]
    assert sorted(marked) == ["test_lessons", "test_suite_phases"]       # (this test names the marker)


def test_the_makefile_runs_both_phases():
    recipe = (TESTS.parent / "Makefile").read_text().split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "-m together -n 2 --dist loadfile" in recipe and '-m "not together" -n 2 --dist loadgroup' in recipe
