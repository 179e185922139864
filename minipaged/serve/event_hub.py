"""The ``/v1/events`` fan-out: each StepEvent is serialised and framed once, and the same bytes go to every
watcher; each watcher has a bounded buffer, and one that falls behind is dropped.

Why: a classroom is one engine and dozens of browsers. Serialising an event per watcher, or letting a stalled
browser's backlog grow, would make the teacher's machine pay for every student; here a step costs one
``json.dumps`` (in the API server, of the event the core serialised once), one framing, and one ``deque.append`` of the same ``bytes`` per
watcher (on the event loop).

A watcher whose unsent bytes pass ``limit_bytes`` (counted as sent, and uncompressed: an event that gzip shrank
under the limit still costs the browser its whole size to unpack and parse) loses its backlog at once (the
memory goes back) and gets, if its connection can still be written, ``event: dropped`` with the reason; then
its connection closes. It
reconnects and starts again from a fresh snapshot (skipping events would corrupt its block map).

Compression: with ``Accept-Encoding: gzip`` a watcher gets a gzip stream, still compressed once per event.
Each event is deflated on its own (a fresh compressor, flushed to a byte boundary), and independent deflate
blocks concatenate into one valid deflate stream, so the same compressed bytes serve every gzip watcher; each
watcher only adds the 10-byte gzip header, keeps a running CRC-32, and ends with the trailer.
"""
from __future__ import annotations

import asyncio
import json
import logging
import zlib
from collections import deque
from typing import Any, AsyncIterator, Callable, Optional, Sequence, Union

from starlette.responses import Response

from .fair_share import on_this_machine
from .limits import WATCHER_BUFFER_BYTES
from .liveness import HEARTBEAT, goodbye_event
from .protocol import ServerError

logger = logging.getLogger("minipaged.serve")

GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"   # deflate, no name, no time, unknown OS
DEFLATE_END = zlib.compressobj(wbits=-15).flush()            # an empty final block


def deflate_alone(data: bytes) -> bytes:
    """Raw deflate blocks of ``data`` that do not refer to anything before them and end on a byte."""
    compressor = zlib.compressobj(6, zlib.DEFLATED, -15)
    return compressor.compress(data) + compressor.flush(zlib.Z_SYNC_FLUSH)


class Chunk:
    """One framed SSE message, shared by all watchers; its compressed form is made once, when first asked."""

    __slots__ = ("plain", "_deflated")

    def __init__(self, plain: bytes) -> None:
        self.plain = plain
        self._deflated: Optional[bytes] = None

    @classmethod
    def data(cls, payload: str) -> "Chunk":
        return cls(b"data: " + payload.encode() + b"\n\n")

    @property
    def deflated(self) -> bytes:
        if self._deflated is None:
            self._deflated = deflate_alone(self.plain)
        return self._deflated


class Watcher:
    """One ``/v1/events`` client: a bounded queue of bytes ready to send, on the event loop."""

    def __init__(self, gzip: bool = False, limit_bytes: int = WATCHER_BUFFER_BYTES, sees_text: bool = True) -> None:
        self.gzip = gzip
        self.sees_text = sees_text               # False: it gets the copy without others' text (teacher.py)
        self.limit_bytes = limit_bytes
        self.queue: deque[tuple[bytes, int]] = deque()   # (bytes to send, their uncompressed size)
        self.queued_bytes = 0
        self.queued_plain_bytes = 0              # what the client must unpack and parse: counts against the limit
        self.closed = False                      # nothing more will be queued (after the queue: the end)
        self.dropped: Optional[str] = None       # why it was dropped, if it was
        self._ready = asyncio.Event()
        self._crc = 0
        self._size = 0
        self._started = False

    def encode(self, chunk: Chunk) -> bytes:
        """The bytes of ``chunk`` on this watcher's connection (per-watcher work: a CRC-32 when gzipped)."""
        if not self.gzip:
            return chunk.plain
        self._crc = zlib.crc32(chunk.plain, self._crc)
        self._size += len(chunk.plain)
        if not self._started:
            self._started = True
            return GZIP_HEADER + chunk.deflated
        return chunk.deflated

    def offer(self, chunk: Chunk) -> None:
        """Queue ``chunk``, or drop this watcher if that would pass its limit."""
        if self.closed:
            return
        data = self.encode(chunk)
        if max(self.queued_bytes + len(data), self.queued_plain_bytes + len(chunk.plain)) > self.limit_bytes:
            self.drop(f"more than {self.limit_bytes // 1024} KiB of events (uncompressed) waited to be sent to "
                      f"this watcher")
            return
        self.queue.append((data, len(chunk.plain)))
        self.queued_bytes += len(data)
        self.queued_plain_bytes += len(chunk.plain)
        self._ready.set()

    def say(self, text: str) -> None:
        """Queue a message for this watcher alone (an SSE comment or a named event), whatever its backlog."""
        if not self.closed:
            chunk = Chunk(text.encode())
            self.queue.append((self.encode(chunk), len(chunk.plain)))
            self._ready.set()

    def drop(self, reason: str) -> None:
        self.queue.clear()                       # the backlog's memory goes back now
        self.queued_bytes = self.queued_plain_bytes = 0
        self.say(f"event: dropped\ndata: {json.dumps({'reason': reason})}\n\n")
        self.dropped = reason
        self.close()
        logger.warning("dropped an event-stream watcher: %s", reason)

    def close(self) -> None:
        self.closed = True
        self._ready.set()

    async def stream(self, heartbeat_s: Optional[float] = None) -> AsyncIterator[bytes]:
        """The bytes to send, as they come; ends once the watcher is closed and its queue is sent. With
        ``heartbeat_s``, an SSE comment (``: heartbeat``) whenever nothing was sent for that long, so that a
        client can tell a quiet engine from a lost server."""
        while True:
            while self.queue:
                data, plain_size = self.queue.popleft()
                self.queued_bytes = max(0, self.queued_bytes - len(data))
                self.queued_plain_bytes = max(0, self.queued_plain_bytes - plain_size)
                yield data
            if self.closed:
                if self.gzip:
                    yield (b"" if self._started else GZIP_HEADER) + DEFLATE_END + \
                        (self._crc & 0xFFFFFFFF).to_bytes(4, "little") + (self._size & 0xFFFFFFFF).to_bytes(4, "little")
                return
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), heartbeat_s)
            except asyncio.TimeoutError:
                self.say(HEARTBEAT)


class EventHub:
    """The watchers of one server, on the event loop. ``async_engine`` calls ``publish`` with each event's JSON,
    once."""

    def __init__(self) -> None:
        self.watchers: list[Watcher] = []

    def add(self, watcher: Watcher, first: Sequence[Union[str, Chunk]]) -> None:
        """Register ``watcher``, queueing ``first`` (the engine header and the snapshot; framed already where
        watchers joining in the same step share them) before any step."""
        for payload in first:
            watcher.offer(payload if isinstance(payload, Chunk) else Chunk.data(payload))
        self.watchers.append(watcher)

    def publish(self, payload: str, without_text: Optional[str] = None) -> None:
        """Queue one event for every watcher: ``payload``, or ``without_text`` (its copy without others' text,
        made once too) for watchers that may not see text."""
        chunk = Chunk.data(payload)
        hidden = chunk if without_text is None else Chunk.data(without_text)
        for watcher in self.watchers:
            watcher.offer(chunk if watcher.sees_text else hidden)
        if any(w.closed for w in self.watchers):
            self.watchers = [w for w in self.watchers if not w.closed]

    def remove(self, watcher: Watcher) -> None:
        watcher.close()
        if watcher in self.watchers:
            self.watchers.remove(watcher)

    def close_all(self, goodbye: Optional[str] = None) -> None:
        """End every watcher's stream; with ``goodbye``, after ``event: goodbye`` and that reason."""
        for watcher in self.watchers:
            if goodbye is not None:
                watcher.say(goodbye_event(goodbye))
            watcher.close()
        self.watchers = []


class StreamLimits:
    """How many ``/v1/events`` streams are open, per client and in all, with the refusals past the caps.

    Why: each stream costs a snapshot, a backlog of up to ``--event-buffer-mb`` here and, when
    its reader stops reading, the kernel's socket buffers: 240 streams that never read pinned 700-800 MB of TCP
    memory and paused another client's stream for seconds. One client (an address: a class shares one API key)
    past ``per_client`` gets 429, as a student with too many tabs; the API key's holder (the teacher) and this
    machine (the teacher, a classroom's terminals, a benchmark, as in ``fair_share``) have no per-client bound.
    Everyone together past ``total`` gets 503: the server is full, not the client at fault."""

    def __init__(self, per_client: int, total: int) -> None:
        self.per_client, self.total = per_client, total
        self.clients: dict[Watcher, Optional[str]] = {}     # open stream -> its client (None: not bounded)
        self.counts: dict[str, int] = {}

    def admit(self, watcher: Watcher, client: str, exempt: bool) -> None:
        """Count ``watcher``, or raise the 503 or 429 that refuses it."""
        if len(self.clients) >= self.total:
            raise ServerError(503, f"this server already has {self.total} event streams open, the most it serves "
                                   f"(minipaged serve --max-event-streams): retry in a while.",
                              headers={"Retry-After": "5"})
        bounded = None if exempt or on_this_machine(client) else client
        if bounded is not None:
            if self.counts.get(bounded, 0) >= self.per_client:
                raise ServerError(429, f"this client already has {self.per_client} event streams open, the most "
                                       f"one client may (minipaged serve --max-client-event-streams): close another "
                                       f"tab of the page first.", headers={"Retry-After": "5"})
            self.counts[bounded] = self.counts.get(bounded, 0) + 1
        self.clients[watcher] = bounded

    def release(self, watcher: Watcher) -> None:
        """The stream ended, however it ended (twice is harmless)."""
        if watcher not in self.clients:
            return
        client = self.clients.pop(watcher)
        if client is not None:
            self.counts[client] -= 1
            if self.counts[client] <= 0:
                del self.counts[client]                 # a client with no stream costs no memory


class WatcherResponse(Response):
    """The ASGI response of one watcher: its bytes as they come, until the watcher ends or the client leaves.

    A dropped watcher's backlog is gone already, so even a client that never reads again holds only what the
    connection had taken in; if it reads again it gets "dropped" and the end of the stream, and reconnects."""

    def __init__(self, watcher: Watcher, headers: dict[str, str], on_end: Callable[[], Any],
                 heartbeat_s: Optional[float] = None, goodbye: Optional[asyncio.Event] = None,
                 reason: Callable[[], str] = lambda: "the server is shutting down") -> None:
        super().__init__(media_type="text/event-stream", headers=headers)
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]   # it streams
        if watcher.gzip:
            self.headers["content-encoding"] = "gzip"
            self.headers["vary"] = "Accept-Encoding"
        self.watcher = watcher
        self.on_end = on_end
        self.heartbeat_s, self.goodbye, self.reason = heartbeat_s, goodbye, reason

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for data in self.watcher.stream(self.heartbeat_s):
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def client_left() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        async def say_goodbye() -> None:         # the server drains: the stream's last words, then its end
            assert self.goodbye is not None
            await self.goodbye.wait()
            self.watcher.say(goodbye_event(self.reason()))
            self.watcher.close()
            await asyncio.Event().wait()         # the pump ends the stream

        sending = asyncio.ensure_future(pump())
        tasks = {sending, asyncio.ensure_future(client_left())}
        if self.goodbye is not None:
            tasks.add(asyncio.ensure_future(say_goodbye()))
        try:
            await asyncio.wait({sending, *tasks}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.on_end()
