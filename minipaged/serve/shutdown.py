"""A uvicorn server that drains on SIGTERM (and Ctrl-C) instead of cutting streams after a 2 s grace.

uvicorn's own handler stops listening at once and cancels what is still running after
``timeout_graceful_shutdown``; a load balancer's SIGTERM would cut every stream mid-sentence. Here the first
signal runs the app's ``drain`` (new requests get 503 while the port stays open, running ones finish for up to
``--shutdown-timeout``, the rest end with an error event, event streams get ``goodbye``) and only then asks
uvicorn to exit; the process exits 0. A second signal exits at once.
"""
from __future__ import annotations

import asyncio
import signal
import sys
from types import FrameType
from typing import Any, Awaitable, Callable, Optional

import uvicorn


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain = drain
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._drain_task: Optional[asyncio.Future] = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        # Not uvicorn's: it records the signal and raises it again once the server is down, which makes the
        # process die of SIGTERM (exit status 143) after a clean shutdown.
        if sig not in (signal.SIGTERM, signal.SIGINT) or self._loop is None or self._drain_task is not None:
            self.should_exit = self.force_exit = True          # the second signal: now
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        print("minipaged serve: draining: no new requests, running ones may finish (a second Ctrl-C or SIGTERM "
              "stops at once)", file=sys.stderr, flush=True)
        async def drain_then_exit() -> None:
            try:
                await self._drain()
            finally:
                self.should_exit = True
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(drain_then_exit())
