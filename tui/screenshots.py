"""Pictures of ``minipaged watch`` for the README, rendered headless from a recorded trace.

    python -m minipaged.tui.screenshots TRACE OUT_DIR NAME=STEP[:REQUEST] ... [--size 160x48]

writes OUT_DIR/NAME.svg and NAME.png for each moment (the app at that step, REQUEST selected). Replaying a
trace makes the pictures reproducible: the same trace gives the same screens. The ``s`` key of
``minipaged watch`` saves the screen on show the same way (``save_screen``).

PNGs come from resvg (the ``resvg-py`` wheel: a Rust SVG renderer with no system library to install;
cairosvg would need the cairo C library, which laptops often lack).
"""
from __future__ import annotations

import argparse
import asyncio
import re
from pathlib import Path
from typing import Any, Optional

from minipaged.events import read_trace

# Textual's SVG asks for Fira Code from a CDN; resvg fetches nothing, so name fonts that systems have
# (Linux, macOS, Windows), else it draws no text at all.
MONOSPACE = "DejaVu Sans Mono, Menlo, Consolas, Liberation Mono, monospace"


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


async def render(trace: str, step: int, selected: Optional[str], size: tuple[int, int]) -> str:
    """The SVG of the app paused at ``step`` with ``selected`` selected."""
    from .app import WatchApp

    app = WatchApp(replay=read_trace(trace), paused=True)
    async with app.run_test(size=size) as pilot:
        app.go_to(step)
        if selected:
            app.select(selected)
        await pilot.pause()
        return app.export_screenshot(title=f"minipaged watch, step {step}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minipaged.tui.screenshots", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("out_dir")
    parser.add_argument("moments", nargs="+", metavar="NAME=STEP[:REQUEST]")
    parser.add_argument("--size", default="160x48", help="terminal columns x lines")
    args = parser.parse_args(argv)
    width, height = (int(v) for v in args.size.lower().split("x"))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for moment in args.moments:
        name, _, where = moment.partition("=")
        step, _, selected = where.partition(":")
        svg = asyncio.run(render(args.trace, int(step), selected or None, (width, height)))
        print("wrote " + ", ".join(str(path) for path in write_pictures(svg, out / name)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
