"""Helpers for Pilot tests of the Textual apps (no pytest async plugin needed)."""
from __future__ import annotations

import asyncio
import functools
import time


def run_async(test):
    """Run an async test with asyncio.run; fixtures still work."""
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        asyncio.run(test(*args, **kwargs))
    return wrapper


async def wait_for(pilot, condition, timeout: float = 60.0) -> None:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "timed out waiting for the app"
        await pilot.pause(0.02)
