"""Helpers for Pilot tests of the Textual apps (no pytest async plugin needed)."""
from __future__ import annotations

import asyncio
import functools

PAUSE_S = 0.02


def run_async(test):
    """Run an async test with asyncio.run; fixtures still work."""
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        asyncio.run(test(*args, **kwargs))
    return wrapper


async def wait_for(pilot, condition, timeout: float = 60.0) -> None:
    """Wait for what the app shows. ``timeout`` is a hang guard counted in short pauses (timeout / 0.02 of them;
    on a busy machine each lasts longer), not read from a clock: a test waiting here measures no time, so it may
    run beside another (tests/conftest.py)."""
    for _ in range(int(timeout / PAUSE_S)):
        if condition():
            return
        await pilot.pause(PAUSE_S)
    assert condition(), "timed out waiting for the app"
