"""Pictures of ``minipaged watch`` for the docs, rendered headless from a recorded trace.

    python -m minipaged.tui.screenshots TRACE OUT_DIR NAME=STEP[:REQUEST] ... [--size 160x48]

writes OUT_DIR/NAME.svg and NAME.png for each moment (the app at that step, REQUEST selected). Replaying a
trace makes the pictures reproducible: the same trace gives the same screens.

The pictures are written by ``pictures`` (SVG, and PNG through resvg), as the ``s`` key writes them.
"""
from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Optional

from minipaged.trace import read_trace

from .pictures import write_pictures


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
