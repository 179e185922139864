"""Texts whose numbers are measured: ``{{name.key:spec}}`` placeholders filled from the JSON a run wrote.

The lessons (``lessons/*.md`` from ``measured*.json``) and the docs (``docs/*.md.in`` from ``bench/out/*.json``
and ``docs/tuning.json``) are written this way, so that text and numbers cannot drift apart: a test renders
the template again and compares it with what is checked in, and another finds any digit typed by hand.

A placeholder is a dotted path into the values, walked through dicts (and lists, by index), with an optional
Python format spec: ``{{measured.hit_rate:.0%}}``, ``{{decode_floor.batches.64.efficiency:.2f}}``, or a bare
key, ``{{baseline_tps:.1f}}``. This module imports nothing heavy, so the tests that use it take milliseconds.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z0-9_][A-Za-z0-9_.-]*?)\s*(?::([^}]*))?\}\}")


def placeholders(template: str) -> list[str]:
    """The keys a template asks for, in order of first use."""
    return list(dict.fromkeys(m.group(1) for m in PLACEHOLDER.finditer(template)))


def lookup(values: Mapping[str, Any], key: str) -> Any:
    """The value at dotted path ``key``; a KeyError names the part that is missing and what is there."""
    node: Any = values
    walked: list[str] = []
    for part in key.split("."):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            have = sorted(node) if isinstance(node, Mapping) else f"a {type(node).__name__}"
            raise KeyError(f"{key} is not known: {'.'.join(walked) or 'the values'} has no {part!r} (have: {have})")
        walked.append(part)
    return node


def fill(template: str, values: Mapping[str, Any], booleans: tuple[str, str] = ("off", "on")) -> str:
    """Replace every placeholder with its formatted value (a bool as ``booleans[value]``); an unknown key
    raises KeyError naming it."""
    def sub(m: re.Match) -> str:
        value = lookup(values, m.group(1))
        if isinstance(value, bool):
            return booleans[value]
        return format(value, m.group(2) or "")
    return PLACEHOLDER.sub(sub, template)


def hand_written_numbers(template: str, allowed: Iterable[str] = (), quotations: bool = False) -> list[str]:
    """The template's lines that still hold a digit once placeholders, code (fenced and inline), link targets,
    HTML comments, ``"quotations"`` (when asked: the lessons quote vLLM's docs) and the ``allowed`` regular
    expressions are taken out: numbers typed by hand."""
    text = re.sub(r"```.*?```", "", template, flags=re.S)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = PLACEHOLDER.sub("", text)
    text = re.sub(r"`[^`]*`", "", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    if quotations:
        text = re.sub(r'"[^"]*"', "", text, flags=re.S)
    for pattern in allowed:
        text = re.sub(pattern, "", text, flags=re.M)
    return [line for line in text.splitlines() if re.search(r"\d", line)]
