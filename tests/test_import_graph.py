"""No import cycles anywhere, and no benchmark script that imports another.

The graph is read from the source with ``ast``, not by importing anything: every ``import`` and
``from ... import`` counts, at module level and inside functions (a lazy import still ties two modules
together; hiding one in a function does not break a cycle, it only postpones it), except those under
``if TYPE_CHECKING:``, which Python never runs (they name types for readers and checkers). Relative imports are
resolved, and the repository's top-level folders are named as they are installed: ``kernels/`` is
``minipaged.kernels``, ``tui/`` is ``minipaged.tui``, ``lessons/`` is ``minipaged.lessons``. Importing
``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, as Python does, so it is an edge to each of them too
(except the importer's own packages, which are already being imported when it runs).

The scripts in ``bench/`` are not a package: each is its own module, named ``bench.<stem>``; a script that
imports another by its bare name (``import tuning`` after putting ``bench/`` on ``sys.path``) is an edge
too. A script takes what it shares from ``minipaged.bench``, never from another script.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from minipaged.bench.anatomy import (PACKAGES, ROOT, SCRIPTS, imported_names, import_graph, module_name,  # noqa: F401
                                     packages_above, source_files)


def find_cycle(graph: dict[str, set[str]], within: set[str] | None = None) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]`` (among the nodes ``within``, default all), or None: a depth-first
    search that colours the nodes on its current path."""
    nodes = set(graph) if within is None else within
    state: dict[str, int] = {}                 # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, set()) & nodes):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(nodes):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def tangles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The tangles of modules: each group (larger than one module) in which every module imports every other,
    directly or through the others (a strongly connected component)."""
    def reachable(start: str) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reach = {node: reachable(node) for node in graph}
    found, placed = [], set()
    for node in sorted(graph):
        if node in placed:
            continue
        tangle = {other for other in reach[node] if node in reach.get(other, ())}
        placed |= tangle
        if len(tangle) > 1:
            found.append(tangle)
    return found


def all_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle from each tangle, so a failure names every place to fix at once, not just the first."""
    return [find_cycle(graph, tangle) for tangle in tangles(graph)]


def test_the_project_has_no_import_cycle():
    graph = import_graph()
    found = tangles(graph)
    assert not found, ("import cycles:\n" + "\n".join(
        f"{' -> '.join(find_cycle(graph, t))}  (modules tangled together: {', '.join(sorted(t))})" for t in found)
        + "\nMove what both modules need into the module it belongs to (one that imports neither), rather than "
        "hiding an import inside a function.")


def test_no_benchmark_script_imports_another():
    graph = import_graph()
    offenders = {name: sorted(t for t in targets if t.startswith(f"{SCRIPTS}."))
                 for name, targets in graph.items() if name.startswith(f"{SCRIPTS}.")}
    offenders = {name: targets for name, targets in offenders.items() if targets}
    assert not offenders, (f"bench scripts importing other bench scripts: {offenders}; put what they share in "
                           f"minipaged/bench/ and import it from there")


def test_the_graph_sees_lazy_relative_and_renamed_imports():
    """The reader is what the two tests above rest on: check it on the real tree."""
    graph = import_graph()
    # minipaged/__init__.py imports the engine inside a function, relatively: ``from .engine import Engine``.
    assert "minipaged.engine" in graph["minipaged"]
    # minipaged/model/llama.py reaches kernels/ through its installed name.
    assert any(t.startswith("minipaged.kernels") for t in graph["minipaged.model.llama"])


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def tree(root: Path, extra: dict[str, str]) -> Path:
    base = {f"{folder}/__init__.py": "" for folder in PACKAGES}
    write(root, base | extra)
    return root


@pytest.mark.parametrize("files, expected", [
    # lazy, relative, between a package and a renamed folder
    ({"minipaged/config.py": "from .spec_decode.config import X\n",
      "minipaged/spec_decode/__init__.py": "",
      "minipaged/spec_decode/config.py": "def f():\n    from ..config import Y\n"},
     {"minipaged.config", "minipaged.spec_decode.config"}),
    ({"tui/app.py": "def f():\n    from minipaged.tui import screenshots\n",
      "tui/screenshots.py": "from .app import App\n"},
     {"minipaged.tui.app", "minipaged.tui.screenshots"}),
    # through a package's __init__, as Python runs it: kernels/build.py -> minipaged.model.loader runs
    # minipaged/model/__init__, which imports llama, which imports minipaged.kernels, whose __init__ imports build
    ({"kernels/__init__.py": "from .build import f\n",
      "kernels/build.py": "def f():\n    from minipaged.model.loader import g\n",
      "minipaged/model/__init__.py": "from .llama import Llama\n", "minipaged/model/loader.py": "def g(): pass\n",
      "minipaged/model/llama.py": "from minipaged.kernels import f\n"},
     {"minipaged.kernels", "minipaged.kernels.build", "minipaged.model", "minipaged.model.llama"}),
    # two scripts that import each other by their bare names
    ({"bench/peer.py": "import tuning\n", "bench/tuning.py": "def f():\n    import peer\n"},
     {"bench.peer", "bench.tuning"}),
])
def test_a_reintroduced_cycle_is_found_and_named(tmp_path, files, expected):
    graph = import_graph(tree(tmp_path, files))
    cycles = all_cycles(graph)
    assert len(cycles) == 1
    assert set(cycles[0]) == expected and cycles[0][0] == cycles[0][-1]


def test_imports_python_never_runs_are_no_edges(tmp_path):
    """Under ``if TYPE_CHECKING:`` an import names a type only; its ``else`` branch runs."""
    graph = import_graph(tree(tmp_path, {
        "minipaged/a.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"
                           "else:\n    from . import c\n"),
        "minipaged/b.py": "from . import a\n", "minipaged/c.py": ""}))
    assert graph["minipaged.a"] == {"minipaged.c"} and all_cycles(graph) == []


def test_a_tree_without_cycles_passes(tmp_path):
    graph = import_graph(tree(tmp_path, {"minipaged/a.py": "from . import b\n", "minipaged/b.py": "import os\n",
                                         "kernels/k.py": "from minipaged import a\n"}))
    assert all_cycles(graph) == []
    assert graph["minipaged.kernels.k"] == {"minipaged.a"}
