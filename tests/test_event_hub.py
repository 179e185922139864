"""The /v1/events fan-out (minipaged/serve/event_hub.py): one serialisation and one compression per event
whatever the number of watchers, valid gzip streams made of shared pieces, bounded buffers."""
from __future__ import annotations

import asyncio
import gzip
import json

from minipaged.serve.event_hub import Chunk, EventHub, Watcher


async def drain(watcher: Watcher) -> bytes:
    return b"".join([data async for data in watcher.stream()])


def test_every_watcher_gets_the_same_bytes_and_gzip_ones_a_valid_stream():
    async def run() -> tuple[list[bytes], int]:
        hub = EventHub()
        watchers = [Watcher(gzip=g) for g in (False, True, True)]
        for w in watchers:
            hub.add(w, ['{"type":"engine"}'])
        compressions = 0
        original = Chunk.deflated.fget

        def counting(chunk: Chunk) -> bytes:
            nonlocal compressions
            if chunk._deflated is None:
                compressions += 1
            return original(chunk)
        Chunk.deflated = property(counting)
        try:
            for step in range(50):
                hub.publish(json.dumps({"type": "step", "step": step, "pad": "x" * step}))
            watchers[2].say(": heartbeat\n\n")               # a message to one watcher alone
        finally:
            Chunk.deflated = property(original)
        hub.close_all()
        return [await drain(w) for w in watchers], compressions

    (plain, zipped, zipped_hb), compressions = asyncio.run(run())
    assert compressions == 51                                    # the header and 50 events, once each
    assert gzip.decompress(zipped) == plain                      # the trailer's CRC and length check out
    assert gzip.decompress(zipped_hb) == plain + b": heartbeat\n\n"
    assert plain.count(b"data: ") == 51 and plain.startswith(b'data: {"type":"engine"}\n\n')


def test_a_watcher_past_its_limit_loses_its_backlog_and_is_told_why():
    async def run() -> tuple[bytes, Watcher, Watcher, EventHub]:
        hub = EventHub()
        slow, fine = Watcher(limit_bytes=10_000), Watcher(limit_bytes=10_000)
        hub.add(slow, [])
        hub.add(fine, [])
        sent = b""
        for step in range(400):
            hub.publish(json.dumps({"step": step, "pad": "y" * 100}))
            assert slow.queued_bytes <= 10_000
            sent += await fine_take(fine)                        # this one keeps up
        hub.close_all()
        return await drain(slow), slow, fine, hub

    async def fine_take(w: Watcher) -> bytes:
        out = b""
        while w.queue:
            out += w.queue.popleft()[0]
        w.queued_bytes = w.queued_plain_bytes = 0
        return out

    got, slow, fine, hub = asyncio.run(run())
    assert slow.dropped and "KiB" in slow.dropped
    assert got.startswith(b"event: dropped\ndata: ") and got.count(b"\n\n") == 1   # the backlog went
    assert slow not in hub.watchers and fine.dropped is None


def test_a_gzip_watcher_is_dropped_by_the_size_its_client_must_unpack():
    """A repetitive event shrinks below the limit under gzip, but the browser unpacks and parses it whole."""
    async def run() -> tuple[Watcher, Watcher]:
        hub = EventHub()
        zipped, small = Watcher(gzip=True, limit_bytes=100_000), Watcher(gzip=True, limit_bytes=100_000)
        hub.add(zipped, [])
        hub.add(small, [])
        hub.publish(json.dumps({"prompt": "=" * 20_000}))
        assert zipped.queued_bytes < 1_000 and zipped.queued_plain_bytes > 20_000
        hub.remove(small)
        hub.publish(json.dumps({"prompt": "=" * 200_000}))      # ~1 KB compressed, 200 KB to parse
        return zipped, small

    zipped, small = asyncio.run(run())
    assert zipped.dropped and "uncompressed" in zipped.dropped
    assert small.dropped is None


def test_a_quiet_stream_gets_heartbeats_and_a_closing_one_a_goodbye():
    async def run() -> bytes:
        hub = EventHub()
        w = Watcher(gzip=True)
        hub.add(w, ['{"type":"engine"}'])
        chunks = []

        async def read() -> None:
            async for data in w.stream(heartbeat_s=0.05):
                chunks.append(data)
        reader = asyncio.ensure_future(read())
        await asyncio.sleep(0.18)
        hub.close_all(goodbye="the server is shutting down")
        await reader
        return b"".join(chunks)

    text = gzip.decompress(asyncio.run(run())).decode()
    assert text.startswith('data: {"type":"engine"}\n\n: heartbeat\n\n') and text.count(": heartbeat") >= 2
    assert text.endswith('event: goodbye\ndata: {"reason": "the server is shutting down"}\n\n')


def test_watchers_joining_in_one_step_share_one_snapshot_and_the_next_step_makes_a_new_one(tiny_model_untied,
                                                                                          monkeypatch):
    """A class that opens its pages at once (or 125 connections that never read) costs one serialisation of the
    engine's state a step, on the loop that answers everyone, not one a watcher: the same bytes are queued for
    each (a watcher without others' text gets its own copy, made once too); after a step a new one is made."""
    from minipaged import Engine, SamplingParams
    from minipaged.serve import async_engine as module

    engine = Engine(tiny_model_untied, block_size=4, num_blocks=64)
    events = []
    engine.subscribe(events.append)
    engine.add_request([3, 4, 5], SamplingParams(max_tokens=2))
    engine.step()
    served = module.AsyncEngine(engine)
    made = []
    monkeypatch.setattr(module, "snapshot_event", lambda view, real=module.snapshot_event: made.append(1) or real(view))
    first, second, hidden = Watcher(), Watcher(), Watcher(sees_text=False)
    for watcher in (first, second, hidden):
        served.watch(watcher)
    assert len(made) == 2 and first.queue[1][0] is second.queue[1][0] and hidden.queue[1][0] is not first.queue[1][0]
    served._on_step([], events[-1])
    later = Watcher()
    served.watch(later)
    assert len(made) == 3 and later.queue[1][0] is not first.queue[1][0]
    engine.close()
