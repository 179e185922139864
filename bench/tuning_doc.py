"""Render docs/tuning.md and the README's peer-comparison section from their templates and docs/tuning.json.

The numbers in those texts are placeholders, ``{{baseline_tps:.1f}}`` (a key of the JSON's ``values`` and an
optional Python format spec), filled from the JSON that ``bench/tuning.py`` writes. Text and numbers
therefore cannot drift apart: a test renders the templates again and compares with what is checked in.

This module imports nothing heavy, so that test runs in a blink.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RESULTS = DOCS / "tuning.json"
TUNING_TEMPLATE, TUNING_DOC = DOCS / "tuning.md.in", DOCS / "tuning.md"
PEER_TEMPLATE, README = DOCS / "peer.md.in", ROOT / "README.md"
# The README's section between these lines is the rendered peer template; the rest of the README is by hand.
PEER_BEGIN = "<!-- peer comparison: rendered by bench/tuning_doc.py from docs/peer.md.in; do not edit by hand -->"
PEER_END = "<!-- end of peer comparison -->"
GENERATED_NOTE = ("<!-- rendered by bench/tuning_doc.py from docs/tuning.md.in and docs/tuning.json; edit those "
                  "and run `python bench/tuning_doc.py` -->\n")

PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z0-9_]+)(?::([^}]*))?\s*\}\}")


def placeholders(template: str) -> list[str]:
    """The keys a template asks for, in order of first use."""
    return list(dict.fromkeys(m.group(1) for m in PLACEHOLDER.finditer(template)))


def render(template: str, values: dict[str, Any]) -> str:
    """Fill every ``{{key:spec}}``; a key the JSON lacks raises KeyError naming it."""
    def fill(m: re.Match) -> str:
        key, spec = m.group(1), m.group(2) or ""
        if key not in values:
            raise KeyError(f"{{{{{key}}}}} is used in a template but docs/tuning.json has no such value; "
                           f"rerun python bench/tuning.py")
        return format(values[key], spec)
    return PLACEHOLDER.sub(fill, template)


def load_values(path: Path = RESULTS) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))["values"]


def rendered_tuning_doc(values: dict[str, Any]) -> str:
    return GENERATED_NOTE + render(TUNING_TEMPLATE.read_text(encoding="utf-8"), values)


def peer_section(values: dict[str, Any]) -> str:
    return f"{PEER_BEGIN}\n{render(PEER_TEMPLATE.read_text(encoding='utf-8'), values).strip()}\n{PEER_END}"


def readme_with_peer_section(readme: str, values: dict[str, Any]) -> str:
    """The README with its peer section replaced by a fresh rendering (the markers must be there)."""
    start, end = readme.find(PEER_BEGIN), readme.find(PEER_END)
    if start < 0 or end < start:
        raise ValueError(f"README.md has no peer-comparison markers; put these two lines where the section "
                         f"goes:\n{PEER_BEGIN}\n{PEER_END}")
    return readme[:start] + peer_section(values) + readme[end + len(PEER_END):]


def write_all(values: dict[str, Any]) -> None:
    TUNING_DOC.write_text(rendered_tuning_doc(values), encoding="utf-8")
    README.write_text(readme_with_peer_section(README.read_text(encoding="utf-8"), values), encoding="utf-8")
    print(f"wrote {TUNING_DOC.relative_to(ROOT)} and the peer section of README.md")


if __name__ == "__main__":          # re-render after editing a template, without measuring again
    write_all(load_values())
