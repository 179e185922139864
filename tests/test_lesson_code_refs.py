"""Each lesson's "Where it lives in the code" names code that exists, in the file it links to.

A bullet of that section links one or more files (``[minipaged/scheduler.py](../minipaged/scheduler.py)``,
relative to ``lessons/``; a linked folder such as ``../kernels/`` means any .py file in it) and names code
in backticks. Every backticked thing in the bullet must hold in one of the bullet's linked files:

* a name, ``_admit_waiting``: defined there (``def``, ``class``, an assignment, an attribute assigned such as
  ``self.x = ...``, a dataclass field). A dotted name, ``KVCacheManager.allocate_slots``, is checked part by
  part: each part is defined inside the one before it.
* a piece of code, anything with a space or ``=`` in it (``num_new = budget``): appears there verbatim.
* an engine option, ``policy``, or one of its values, ``static``: an ``EngineConfig`` field (or one of a
  flag's choices, from ``minipaged.options``) that the file reads (``config.policy``) or compares with
  (``"static"``).

Anything else fails, naming the lesson, the name and the file, so a rename in the code that leaves a
lesson pointing at nothing is caught here.
"""
from __future__ import annotations

import ast
import re
from dataclasses import fields
from pathlib import Path

import pytest

from minipaged.config import EngineConfig
from minipaged.options import engine_flags

ROOT = Path(__file__).resolve().parent.parent
LESSONS = ROOT / "lessons"
HEADING = "## Where it lives in the code"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]+)[^)]*\)")           # [text](target) -> target, no #anchor
CODE = re.compile(r"`([^`\n]+)`")

OPTION_NAMES = {f.name for f in fields(EngineConfig)}
OPTION_VALUES = {value for flag in engine_flags() for value in flag.choices or ()}


def code_section(markdown: str) -> str:
    """The text under the "Where it lives in the code" heading, up to the next heading of its level."""
    if HEADING not in markdown:
        return ""
    return re.split(r"^## ", markdown.split(HEADING, 1)[1], flags=re.MULTILINE)[0]


def bullets(section: str) -> list[str]:
    """The section's list items, each with its continuation lines joined on."""
    items: list[str] = []
    for line in section.splitlines():
        if line.startswith("- "):
            items.append(line[2:])
        elif line.startswith(" ") and line.strip() and items:
            items[-1] += " " + line.strip()
    return items


def defined_names(node: ast.AST) -> set[str]:
    """Every name defined anywhere inside ``node``: functions, classes, assigned names and attributes."""
    names: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in n.targets if isinstance(n, ast.Assign) else [n.target]:
                for t in ast.walk(target):
                    if isinstance(t, ast.Name):
                        names.add(t.id)
                    elif isinstance(t, ast.Attribute):
                        names.add(t.attr)
    return names


def defines(tree: ast.AST, dotted: str) -> bool:
    """Whether ``tree`` defines ``dotted``: ``A.b`` needs a def or class ``A`` that defines ``b`` inside it."""
    *outer, last = dotted.split(".")
    scopes = [tree]
    for part in outer:
        scopes = [n for scope in scopes for n in ast.walk(scope)
                  if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == part]
    return any(last in defined_names(scope) for scope in scopes)


def reads_option(tree: ast.AST, word: str) -> bool:
    """Whether code reads engine option ``word`` (``config.policy``) or compares with value ``word``."""
    for n in ast.walk(tree):
        if word in OPTION_NAMES and isinstance(n, ast.Attribute) and n.attr == word:
            return True
        if word in OPTION_VALUES and isinstance(n, ast.Constant) and n.value == word:
            return True
    return False


def linked_files(target: str) -> list[Path]:
    path = (LESSONS / target).resolve()
    return sorted(path.rglob("*.py")) if path.is_dir() else [path]


def check_bullet(bullet: str, where: str) -> list[str]:
    """What in one bullet does not hold in the files it links; ``where`` names the lesson in messages."""
    targets = LINK.findall(bullet)
    names = CODE.findall(bullet)
    if names and not targets:
        return [f"{where}: a bullet names {', '.join(names)} but links no file: {bullet[:60]}..."]
    files = [path for target in targets for path in linked_files(target)]
    missing = [t for t in targets if not any(p.exists() for p in linked_files(t))]
    if missing:
        return [f"{where}: links {', '.join(missing)}, which does not exist"]
    sources = {path: path.read_text(encoding="utf-8") for path in files}
    trees = {path: ast.parse(text) for path, text in sources.items()}
    shown = " or ".join(targets)
    problems = []
    for name in names:
        if " " in name or "=" in name:
            if not any(name in text for text in sources.values()):
                problems.append(f"{where}: the code `{name}` does not appear verbatim in {shown}")
        elif name.replace(".", "").replace("_", "").isalnum():
            if any(defines(tree, name) for tree in trees.values()):
                continue
            if name in OPTION_NAMES | OPTION_VALUES:
                if not any(reads_option(tree, name) for tree in trees.values()):
                    problems.append(f"{where}: `{name}` is an engine option or option value, but {shown} never "
                                    f"reads or compares with it")
            else:
                problems.append(f"{where}: `{name}` is not defined in {shown}")
        else:
            problems.append(f"{where}: `{name}` is neither a name, a piece of code (with a space or =) nor an "
                            f"engine option")
    return problems


def check_lesson(markdown: str, where: str) -> list[str]:
    section = code_section(markdown)
    items = bullets(section)
    if not items:
        return [f"{where}: no bullets under {HEADING!r}"]
    return [problem for item in items for problem in check_bullet(item, where)]


LESSON_FILES = sorted(LESSONS.glob("lesson*.md"))


def test_every_lesson_is_checked():
    assert len(LESSON_FILES) >= 5


@pytest.mark.parametrize("path", LESSON_FILES, ids=lambda p: p.stem)
def test_the_code_a_lesson_points_at_exists(path):
    problems = check_lesson(path.read_text(encoding="utf-8"), path.name)
    assert not problems, "\n".join(problems)


SCHEDULER = "[minipaged/scheduler.py](../minipaged/scheduler.py)"


@pytest.mark.parametrize("bullet, words", [
    (f"{SCHEDULER}: `no_such_function` admits", "`no_such_function` is not defined in ../minipaged/scheduler.py"),
    (f"{SCHEDULER}: `Scheduler.allocate_slots`", "`Scheduler.allocate_slots` is not defined"),     # the KV cache manager's
    (f"{SCHEDULER}: the chunk, `num_new = everything`", "`num_new = everything` does not appear verbatim"),
    ("[minipaged/request.py](../minipaged/request.py): `static` batching", "never reads or compares with it"),
    (f"{SCHEDULER}: `--no-prefix-caching`", "`--no-prefix-caching` is neither"),
    ("[minipaged/gone.py](../minipaged/gone.py): `schedule`", "links ../minipaged/gone.py, which does not exist"),
    ("[kernels/](../kernels/): `paged_attention_by_magic`", "`paged_attention_by_magic` is not defined in ../kernels/"),
    ("the scheduler: `schedule`", "links no file"),
])
def test_a_stale_reference_is_reported(bullet, words):
    """The check can fail: one good bullet and one stale one give exactly one problem, naming the lesson."""
    markdown = (f"# Lesson 9: fake\n\n{HEADING}\n\n- [minipaged/engine.py](../minipaged/engine.py): `step`\n"
                f"- {bullet}\n\n## Quiz\n")
    problems = check_lesson(markdown, "lesson9_fake.md")
    assert len(problems) == 1 and "lesson9_fake.md" in problems[0] and words in problems[0], problems


def test_good_references_of_every_kind_pass():
    markdown = (f"{HEADING}\n\n- [minipaged/kv_cache_manager.py](../minipaged/kv_cache_manager.py): "
                "`KVCacheManager.allocate_slots`, `PrefixCacheStats`,\n  `hits`, `num_blocks`\n"
                "- [minipaged/scheduler.py](../minipaged/scheduler.py): `num_new = budget`, `policy` `static`\n"
                "- [kernels/](../kernels/): `paged_attention_reference`\n")
    assert check_lesson(markdown, "fake.md") == []
