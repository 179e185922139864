"""Liveness of ``GET /v1/events``: a heartbeat while nothing happens, and a goodbye when the server leaves.

A watcher cannot tell an idle server from a dead or frozen one by silence alone, so after ``heartbeat_s``
seconds without a line the stream sends an SSE comment (``: heartbeat``), which every client ignores but
which resets its read timeout. On a graceful shutdown the stream ends with ``event: goodbye``: a stream
that ends without it means the server was lost (``watch --attach`` says so and exits non-zero).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator, Callable

HEARTBEAT = ": heartbeat\n\n"


def goodbye_event(reason: str) -> str:
    return f"event: goodbye\ndata: {json.dumps({'reason': reason})}\n\n"


async def with_liveness(lines: AsyncIterator[str], heartbeat_s: float, goodbye: asyncio.Event,
                        reason: Callable[[], str]) -> AsyncIterator[str]:
    """``lines`` as they come, a heartbeat after each ``heartbeat_s`` of silence, and the goodbye event (then
    the end) once ``goodbye`` is set."""
    source = lines.__aiter__()
    bye = asyncio.ensure_future(goodbye.wait())
    pending = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(source.__anext__())
            done, _ = await asyncio.wait({pending, bye}, timeout=heartbeat_s, return_when=asyncio.FIRST_COMPLETED)
            if bye in done:
                yield goodbye_event(reason())
                return
            if pending in done:
                try:
                    line = pending.result()
                except StopAsyncIteration:
                    return
                pending = None
                yield line
            else:
                yield HEARTBEAT
    finally:
        bye.cancel()
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        with contextlib.suppress(RuntimeError):
            await source.aclose()         # type: ignore[attr-defined]
