"""Pictures of the screen: Textual's SVG screenshot, and a PNG of it where resvg-py is installed.

The ``s`` key of ``minipaged watch`` saves the screen on show (``save_screen``); ``screenshots`` renders the
docs' pictures from a recorded trace with the same two functions. The keys save into ``pictures_folder()``,
never the working folder: run from a checkout, that is the repository, which then fills with untracked files.

PNGs come from resvg (the ``resvg-py`` wheel: a Rust SVG renderer with no system library to install;
cairosvg would need the cairo C library, which laptops often lack).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Optional

# Textual's SVG asks for Fira Code from a CDN; resvg fetches nothing, so name fonts that systems have
# (Linux, macOS, Windows), else it draws no text at all.
MONOSPACE = "DejaVu Sans Mono, Menlo, Consolas, Liberation Mono, monospace"


PICTURES_ENV = "MINIPAGED_PICTURES"


def pictures_folder() -> Path:
    """Where the TUI's ``s`` (screen) and ``p`` (plot) keys save: $MINIPAGED_PICTURES if set, else the user's
    pictures folder (``~/Pictures/minipaged`` on Linux and macOS); made if missing."""
    given = os.environ.get(PICTURES_ENV)
    if given:
        folder = Path(given).expanduser()
    else:
        import platformdirs
        folder = Path(platformdirs.user_pictures_dir()) / "minipaged"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def svg_to_png(svg: str) -> Optional[bytes]:
    """PNG bytes of a Textual screenshot SVG, or None where resvg-py is not installed."""
    try:
        import resvg_py
    except ImportError:
        return None
    svg = re.sub(r"@font-face \{.*?\}\s*", "", svg, flags=re.S)
    svg = svg.replace("font-family: Fira Code, monospace;", f"font-family: {MONOSPACE};")
    return bytes(resvg_py.svg_to_bytes(svg_string=svg))


def write_pictures(svg: str, stem: Path) -> list[Path]:
    """Write ``stem``.svg and, when it can be made, ``stem``.png; returns the paths written."""
    written = [stem.with_suffix(".svg")]
    written[0].write_text(svg, encoding="utf-8")
    png = svg_to_png(svg)
    if png is not None:
        written.append(stem.with_suffix(".png"))
        written[1].write_bytes(png)
    return written


def save_screen(app: Any, folder: Path) -> list[Path]:
    """The ``s`` key: the screen as it is now, named after the run and step, never overwriting a picture."""
    what = f"lesson{app.lesson.number}" if getattr(app, "lesson", None) else ("live" if app.live else "replay")
    base = f"minipaged-{what}-step{app.position}"
    stem, n = folder / base, 1
    while stem.with_suffix(".svg").exists():
        n += 1
        stem = folder / f"{base}-{n}"
    return write_pictures(app.export_screenshot(title=f"minipaged watch, step {app.position}"), stem)
