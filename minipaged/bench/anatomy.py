"""The engine's anatomy, read from its source: what imports what, the reading order of one request with each
file's line count (docs/architecture.md's table, rendered here and checked by tests/test_anatomy.py), and the
import closures whose budgets keep the engine one a student reads in a sitting.

The graph is read from the source with ``ast``, not by importing anything: every ``import`` and
``from ... import`` counts, at module level and inside functions (a lazy import still ties two modules
together), except those under ``if TYPE_CHECKING:``, which Python never runs (they name types for readers and
checkers). Relative imports are resolved, and the repository's top-level folders are named as they are
installed: ``kernels/`` is ``minipaged.kernels``, ``tui/`` is ``minipaged.tui``, ``lessons/`` is
``minipaged.lessons``. Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, as Python does, so
it is an edge to each of them too (except the importer's own packages, which are already being imported when
it runs). The scripts in ``bench/`` are not a package: each is its own module, named ``bench.<stem>``.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterable, Iterator

ROOT = Path(__file__).resolve().parents[2]
# Folder in the repository -> the package name it is installed as (pyproject's package-dir).
PACKAGES = {"minipaged": "minipaged", "kernels": "minipaged.kernels", "tui": "minipaged.tui",
            "lessons": "minipaged.lessons"}
SCRIPTS = "bench"


def module_name(path: Path, root: Path = ROOT) -> str:
    """The dotted name a file is imported as (``kernels/reference.py`` -> ``minipaged.kernels.reference``)."""
    parts = path.relative_to(root).with_suffix("").parts
    if parts[0] == SCRIPTS:
        return f"{SCRIPTS}.{parts[-1]}"
    parts = (*PACKAGES[parts[0]].split("."), *parts[1:])
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files(root: Path = ROOT) -> dict[str, Path]:
    files = {}
    for folder in (*PACKAGES, SCRIPTS):
        for path in sorted((root / folder).rglob("*.py")):
            files[module_name(path, root)] = path
    return files


def is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def run_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node Python may run: all of them but the bodies of ``if TYPE_CHECKING:`` (their ``else`` runs)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if is_type_checking(node):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))


def imported_names(path: Path, name: str) -> set[tuple[str, str]]:
    """Every import in the file, anywhere in it, as (module, name): ``import a.b`` -> ("a.b", ""),
    ``from a import b`` -> ("a", "b"), relative ones resolved against the file's package."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found: set[tuple[str, str]] = set()
    for node in run_nodes(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update((alias.name, "") for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.update((base, alias.name) for alias in node.names)
    return found


def packages_above(module: str) -> list[str]:
    """The packages whose ``__init__`` Python runs before ``module`` (``a.b.c`` -> ``a``, ``a.b``)."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the project's modules it imports. ``from a import b`` depends on the module ``a.b`` when there
    is one, else on ``a`` (b is a name defined in a). Importing ``a.b`` also runs the package ``a``'s
    ``__init__`` first, so it depends on ``a`` too, unless ``a`` is one of the importer's own packages: those
    are imported before the importer runs (a package that imports its own submodules is how packages are
    built). A submodule that takes a name from its package's ``__init__`` is counted (it really depends on it)."""
    files = source_files(root)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges = set()
        for module, attribute in imported_names(path, name):
            candidates = [f"{module}.{attribute}", module] if attribute else [module]
            if name.startswith(f"{SCRIPTS}."):       # a script importing a sibling script by its bare name
                candidates = [f"{SCRIPTS}.{c}" for c in candidates] + candidates
            target = next((c for c in candidates if c in files), None)
            if target is not None and target != name:
                edges.add(target)
                edges.update(package for package in packages_above(target)
                             if package in files and package != name and package not in packages_above(name))
        graph[name] = edges
    return graph


def closure(graph: dict[str, set[str]], starts: Iterable[str], leave_out: Iterable[str] = ()) -> set[str]:
    """The modules ``starts`` import, directly or not (themselves included); a module in ``leave_out``, or under
    a package named there, is neither counted nor followed."""
    skip = tuple(leave_out)

    def left_out(name: str) -> bool:
        return any(name == s or name.startswith(s + ".") for s in skip)
    seen = {s for s in starts}
    todo = list(seen)
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen and not left_out(nxt):
                seen.add(nxt)
                todo.append(nxt)
    return seen


def line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def size(modules: Iterable[str], root: Path = ROOT) -> tuple[int, int]:
    """(files, lines) of the modules."""
    files = source_files(root)
    modules = list(modules)
    return len(modules), sum(line_count(files[m]) for m in modules)


# ---------------------------------------------------------------------- the engine's shape, and its budgets
# What the engine's own import closure may hold (the builder, which only wires parts, and kernels/ left out):
# the issue that set it measured 43 files and 6,549 lines before the engine core was drawn on vLLM v1's boundary.
ENGINE = "minipaged.engine"
NOT_COUNTED = ("minipaged.engine_builder", "minipaged.kernels")
ENGINE_BUDGET = (20, 3000)
ENGINE_PY_MAX_LINES = 200
# One plain request's whole path, the parts the builder hands in included (the core, the executor, the runner,
# the sampler and the model's forward): a stricter count than the engine's own closure. It also holds what the
# model package's __init__ runs (the loader) and the weights' placement CompactLlama inherits: 25 files and
# 3,772 lines when the budget was set, a guard against growth rather than a target met with room to spare.
REQUEST_PATH = ("minipaged.engine", "minipaged.engine_core", "minipaged.scheduler", "minipaged.kv_cache_manager",
                "minipaged.runner.executor", "minipaged.runner.model_runner", "minipaged.sampling")
REQUEST_PATH_BUDGET = (26, 3850)
# The core (what `minipaged serve` will run in a process of its own) and the observers, who must stay outside it.
CORE = ("minipaged.engine_core", "minipaged.scheduler", "minipaged.kv_cache_manager", "minipaged.block_pool",
        "minipaged.swap", "minipaged.request", "minipaged.runner.executor", "minipaged.runner.model_runner",
        "minipaged.runner.input_batch", "minipaged.runner.outputs", "minipaged.sampling", "minipaged.stats")
OBSERVERS = ("minipaged.events", "minipaged.event_view", "minipaged.trace", "minipaged.step_recorder",
             "minipaged.kv_recorder", "minipaged.prefix_misses", "minipaged.kv_events", "minipaged.metrics")

# ---------------------------------------------------------------------- the reading order of one request
READING_ORDER: tuple[tuple[str, str], ...] = (
    ("minipaged/engine.py", "the front end around the core: `add_request`, `step`, `generate`; what one step does"),
    ("minipaged/input_processor.py", "validate, tokenise, check that the prompt fits, one `Request` per sample"),
    ("minipaged/request.py", "a request's state (`num_computed_tokens`, its status) and `SamplingParams`"),
    ("minipaged/engine_core.py", "one step: schedule -> execute_model -> update_from_output; `EngineCoreOutputs`; "
                                 "async output processing"),
    ("minipaged/scheduler.py", "who runs and how many tokens each, within the token budget; preemption; "
                               "`update_from_output`; `finish_requests`, the one way a request ends"),
    ("minipaged/kv_cache_manager.py", "each request's block table; prefix-cache lookups; swapping"),
    ("minipaged/block_pool.py", "every block, the free queue, the hash map, and the one change log"),
    ("minipaged/swap.py", "the host pool swapped-out requests wait in"),
    ("minipaged/runner/executor.py", "the forward pass and its new tokens, returned as one `ModelRunnerOutput`"),
    ("minipaged/runner/outputs.py", "`ModelRunnerOutput` and `StepTimes`: everything a forward pass hands back"),
    ("minipaged/runner/model_runner.py", "the step's tokens laid end to end, slots and block tables as tensors"),
    ("minipaged/runner/input_batch.py", "a step of plain decodes: the persistent batch, only what changed written"),
    ("minipaged/model/llama.py", "the model's forward over the paged cache (RMSNorm, RoPE, GQA, SwiGLU)"),
    ("minipaged/sampling.py", "greedy, temperature, top-k, top-p, seeds"),
    ("minipaged/output_processor.py", "tokens to text, stop strings (sent back to the core), the step's deltas"),
    ("minipaged/detokenizer.py", "incremental detokenising at constant cost per token"),
    ("minipaged/outputs.py", "what clients get: `RequestDelta`, `RequestOutput`, `StepResult`"),
)
OBSERVERS_ORDER: tuple[tuple[str, str], ...] = (
    ("minipaged/step_recorder.py", "one `StepEvent` a step, from the core's outputs and the front end's text"),
    ("minipaged/kv_recorder.py", "the block pool's change log folded into block changes, KV events, miss reasons"),
    ("minipaged/events.py", "the event schema: `StepEvent`, `EngineInfo` and their records"),
    ("minipaged/engine_builder.py", "where every part is chosen and wired (options, model, backend, pools)"),
)
BEGIN = "<!-- reading order: rendered by python bench/render_docs.py (minipaged/bench/anatomy.py); do not edit -->"
END = "<!-- end of reading order -->"


def reading_order_table(root: Path = ROOT) -> str:
    """The markdown block docs/architecture.md carries between BEGIN and END."""
    def rows(order: tuple[tuple[str, str], ...], first: int) -> list[str]:
        return [f"| {first + i} | [{path}](../{path}) | {line_count(root / path)} | {what} |"
                for i, (path, what) in enumerate(order)]
    graph = import_graph(root)
    engine_files, engine_lines = size(closure(graph, [ENGINE], NOT_COUNTED), root)
    path_files, path_lines = size(closure(graph, REQUEST_PATH, NOT_COUNTED), root)
    head = ["| # | file | lines | what you learn there |", "|---|---|---|---|"]
    return "\n".join([
        BEGIN, "", *head, *rows(READING_ORDER, 1), "",
        "Beside the path, outside the core: the observers and the builder.", "", *head,
        *rows(OBSERVERS_ORDER, len(READING_ORDER) + 1), "",
        f"What `minipaged/engine.py` imports, directly or not (the builder and `kernels/` aside): **{engine_files} "
        f"files, {engine_lines} lines** (budget {ENGINE_BUDGET[0]} and {ENGINE_BUDGET[1]:,}). One plain request's "
        f"whole path, the parts the builder hands in included (engine core, scheduler, KV cache manager, executor, "
        f"runner, sampler, model forward): **{path_files} files, {path_lines} lines** (budget "
        f"{REQUEST_PATH_BUDGET[0]} and {REQUEST_PATH_BUDGET[1]:,}). `tests/test_anatomy.py` keeps both, and keeps "
        f"the observers out of the core.", "", END])


def with_reading_order(text: str, root: Path = ROOT) -> str:
    """``text`` (docs/architecture.md) with its reading-order block rendered anew."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + reading_order_table(root) + text[end:]
