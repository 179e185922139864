"""The engine a student reads in one sitting: the shape that issue 46 drew, kept.

* docs/architecture.md's reading order (each file of one request's path, with its line count) is rendered by
  ``minipaged.bench.anatomy`` and must match the source as it is now;
* what ``minipaged/engine.py`` imports, and one plain request's whole path, stay within their budgets;
* observers (the event schema, its fold, traces, the recorders, metrics) never enter the engine core's imports.
"""
from __future__ import annotations

from pathlib import Path

from minipaged.bench.anatomy import (CORE, ENGINE, ENGINE_BUDGET, ENGINE_PY_MAX_LINES, NOT_COUNTED, OBSERVERS,
                                     REQUEST_PATH, REQUEST_PATH_BUDGET, ROOT, closure, import_graph, line_count,
                                     reading_order_table, size, with_reading_order)

ARCHITECTURE = ROOT / "docs" / "architecture.md"


def test_the_reading_order_in_the_docs_is_the_source_as_it_is():
    text = ARCHITECTURE.read_text(encoding="utf-8")
    assert with_reading_order(text) == text, \
        "docs/architecture.md's reading order is stale: run python bench/render_docs.py"


def test_the_engine_and_one_requests_path_stay_within_their_budgets():
    graph = import_graph()
    files, lines = size(closure(graph, [ENGINE], NOT_COUNTED))
    assert files <= ENGINE_BUDGET[0] and lines <= ENGINE_BUDGET[1], (files, lines)
    assert line_count(ROOT / "minipaged" / "engine.py") <= ENGINE_PY_MAX_LINES
    files, lines = size(closure(graph, REQUEST_PATH, NOT_COUNTED))
    assert files <= REQUEST_PATH_BUDGET[0] and lines <= REQUEST_PATH_BUDGET[1], (files, lines)


def test_no_core_module_imports_an_observer():
    graph = import_graph()
    reached = closure(graph, CORE, NOT_COUNTED)
    assert not reached & set(OBSERVERS), sorted(reached & set(OBSERVERS))


def test_the_checks_see_an_observer_that_sneaks_into_the_core(tmp_path: Path):
    """The checks can fail: a core module that imports the event schema, even lazily inside a function, and a
    path that grows, are both seen (on a copy of the tree's shape)."""
    for folder in ("minipaged", "kernels", "tui", "lessons", "bench"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "minipaged" / "events.py").write_text("X = 1\n" * 400)
    (tmp_path / "minipaged" / "scheduler.py").write_text("def f():\n    from .events import X\n")
    (tmp_path / "minipaged" / "engine.py").write_text("from . import scheduler\n")
    graph = import_graph(tmp_path)
    assert "minipaged.events" in closure(graph, ["minipaged.scheduler"], NOT_COUNTED)
    assert size(closure(graph, ["minipaged.engine"], NOT_COUNTED), tmp_path)[1] > 400
    assert "minipaged.events" not in closure(graph, ["minipaged.engine"], ["minipaged.scheduler"])


def test_the_rendered_table_names_every_file_with_its_lines():
    table = reading_order_table()
    for path in ("minipaged/engine.py", "minipaged/engine_core.py", "minipaged/scheduler.py",
                 "minipaged/block_pool.py", "minipaged/step_recorder.py"):
        assert f"[{path}](../{path}) | {line_count(ROOT / path)} |" in table
