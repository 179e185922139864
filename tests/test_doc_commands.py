"""Every ``minipaged ...`` command the README, docs, lessons and labs quote parses with the CLI's own parser.

A guide that tells a student to type a flag that does not exist (``--workload shared-prefix``, once) stops
the class at that step. Nothing runs here: each command goes through ``make_parser().parse_args`` only.
"""
from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from minipaged.cli import make_parser

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs").glob("*.md.in")),
           *sorted((ROOT / "lessons").glob("*.md")), *sorted((ROOT / "lessons" / "labs").glob("*.md")),
           *sorted((ROOT / "lessons" / "labs").glob("lab*.py"))]
INLINE = re.compile(r"`(minipaged [^`]*)`")
# What a guide writes for "a value of your choice": the parser gets a value of the right kind instead.
PLACEHOLDERS = [(re.compile(r"\{\{[^}]*\}\}"), "1"), (re.compile(r"(?<=--lab )N\b"), "1"),
                (re.compile(r"\s\.\.\.(?=\s|$)"), "")]
SHELL_TAIL = re.compile(r"\s(?:#|\||&&|;|&|>)(?:\s|$).*")      # a comment, a pipe, what runs next


def quoted_commands(path: Path) -> list[tuple[str, str]]:
    """(where, command) for each command in a fenced block (line continuations joined) or an inline span."""
    found, fenced, lines = [], False, path.read_text().splitlines()
    i = 0
    while i < len(lines):
        line, where = lines[i], f"{path.relative_to(ROOT)}:{i + 1}"
        if line.lstrip().startswith("```"):
            fenced = not fenced
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
                parser.parse_args(argv)
        except SystemExit as exit_:
            if exit_.code:
                wrong.append(f"{where}: {command}\n    {err.getvalue().strip().splitlines()[-1]}")
    assert not wrong, "commands the CLI rejects:\n" + "\n".join(wrong)
