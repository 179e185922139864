"""SVG snapshots of ``minipaged watch`` at fixed moments of the committed trace, small and large terminals.

The trace (tests/data/watch_trace.jsonl) was recorded from the embedded SmolLM2 model with

    minipaged watch --no-tui --num-requests 6 --rate 0.5 --max-tokens 48 --num-blocks 24 \\
        --max-num-batched-tokens 32 --preemption-mode swap --num-cpu-blocks 16 --record tests/data/watch_trace.jsonl

Every number on screen comes from the trace (timings included), so the pictures are stable. After an
intended change to the look, review and refresh the baselines with ``pytest tests/test_tui_snapshots.py
--snapshot-update``.

Moments: step 3, r0's long prompt prefilled in chunks of the 32-token budget; step 11, six requests share
the system prompt's blocks (x6); step 31, the pool ran dry and r4, r5 were swapped out to the CPU pool.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from minipaged.trace import read_trace
from minipaged.tui.app import WatchApp

TRACE = Path(__file__).parent / "data" / "watch_trace.jsonl"
SMALL = (100, 30)
LARGE = (200, 60)


def app_at(step: int) -> tuple[WatchApp, object]:
    app = WatchApp(replay=read_trace(str(TRACE)), paused=True)

    async def go(pilot) -> None:
        pilot.app.go_to(step)
        await pilot.pause()

    return app, go


@pytest.mark.parametrize("size", [SMALL, LARGE], ids=["100x30", "200x60"])
@pytest.mark.parametrize("step", [3, 11, 31], ids=["chunked-prefill", "prefix-sharing", "swap-preemption"])
def test_moments(snap_compare, step, size):
    app, go = app_at(step)
    assert snap_compare(app, terminal_size=size, run_before=go)


def test_selected_request_and_help(snap_compare):
    app, go = app_at(31)

    async def select_and_help(pilot) -> None:
        await go(pilot)
        await pilot.press("down", "down", "down", "down")          # r4, swapped out: its CPU blocks light up
        await pilot.press("question_mark")
        await pilot.pause()

    assert snap_compare(app, terminal_size=SMALL, run_before=select_and_help)


def test_selected_swapped_request(snap_compare):
    app, go = app_at(31)

    async def select(pilot) -> None:
        await go(pilot)
        await pilot.press("down", "down", "down", "down")
        await pilot.pause()

    assert snap_compare(app, terminal_size=LARGE, run_before=select)
