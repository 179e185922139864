"""Pictures of ``minipaged watch`` for the README, rendered headless from a recorded trace.

    python -m minipaged.tui.screenshots TRACE OUT_DIR NAME=STEP[:REQUEST] ... [--size 160x48]

writes OUT_DIR/NAME.svg for each moment (the app at that step, REQUEST selected), and NAME.png too when
``cairosvg`` is installed (``pip install cairosvg``; it needs the cairo library). Replaying a trace makes
the pictures reproducible: the same trace gives the same screens.
"""
from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Optional

from minipaged.events import read_trace

from .app import WatchApp


async def render(trace: str, step: int, selected: Optional[str], size: tuple[int, int]) -> str:
    """The SVG of the app paused at ``step`` with ``selected`` selected."""
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
    try:
        import cairosvg
    except (ImportError, OSError):
        cairosvg = None
        print("cairosvg is not available: writing SVG only (pip install cairosvg for PNG).")
    for moment in args.moments:
        name, _, where = moment.partition("=")
        step, _, selected = where.partition(":")
        svg = asyncio.run(render(args.trace, int(step), selected or None, (width, height)))
        (out / f"{name}.svg").write_text(svg, encoding="utf-8")
        if cairosvg is not None:
            cairosvg.svg2png(bytestring=svg.encode("utf-8"), write_to=str(out / f"{name}.png"))
        print(f"wrote {out / name}.{'svg+png' if cairosvg else 'svg'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
