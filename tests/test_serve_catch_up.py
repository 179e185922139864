"""A stream that falls behind the engine catches up: the steps it missed reach it as one delta (vLLM's output
collector merges a slow consumer's outputs the same way), so a busy server writes fewer, larger chunks instead
of falling further behind, and the client gets exactly the same tokens, text and log-probabilities."""
from __future__ import annotations

import asyncio
import threading
import time

from minipaged import Engine
from minipaged.outputs import RequestDelta, SampleDelta
from minipaged.request import SamplingParams
from minipaged.serve.async_engine import Accepted, AsyncEngine

MAX_TOKENS = 24


def test_merging_two_deltas_keeps_the_first_prompt_logprobs_and_the_last_finish():
    first = RequestDelta("r", (SampleDelta(0, "a", (1,), ({1: None},)), SampleDelta(1, "x", (7,))),
                         prompt_logprobs=[None])
    later = RequestDelta("r", (SampleDelta(1, "y", (8,), (), "length"),))
    both = RequestDelta.merged([first, later])
    assert [(s.index, s.text, s.token_ids, s.finish_reason) for s in both.samples] == \
        [(0, "a", (1,), None), (1, "xy", (7, 8), "length")]
    assert both.samples[0].logprobs == ({1: None},) and both.prompt_logprobs == [None] and not both.finished


def test_a_reader_that_falls_behind_gets_the_missed_steps_merged_and_nothing_lost(tiny_model_untied):
    engine = Engine(tiny_model_untied, block_size=4, num_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2, logprobs=2)

    async def main() -> tuple[list[RequestDelta], object]:
        async_engine = AsyncEngine(engine)            # its core runs in a thread (core_client.ThreadCore)
        core_loop = async_engine.core._core
        last_is_out, emit = threading.Event(), core_loop.emit

        def noted_emit(messages):                     # the core hands the loop each pass's messages
            emit(messages)
            if any(m[0] == "step" and any(d.finished for d in m[1]) for m in messages):
                last_is_out.set()
        core_loop.emit = noted_emit
        async_engine.start(asyncio.get_running_loop())
        deltas: list[RequestDelta] = []
        try:
            async for item in async_engine.generate("r1", [3, 4, 5, 6, 7], params, num_samples=2):
                if isinstance(item, Accepted):
                    # The event loop is busy elsewhere (blocked here) until every step's deltas wait for it.
                    assert last_is_out.wait(30), "the request never finished"
                    continue
                deltas.append(item)
        finally:
            await asyncio.to_thread(async_engine.stop, 10.0)
        return deltas, deltas[-1].output

    deltas, output = asyncio.run(asyncio.wait_for(main(), timeout=60))
    # The MAX_TOKENS steps come as two deltas at most: those already in the request's queue when the reader
    # stopped (the engine may have run a few steps by the time it read Accepted), then all the others at once.
    assert len(deltas) <= 2, f"{len(deltas)} deltas: the missed steps were not merged"
    for completion in output.outputs:
        mine = [s for d in deltas for s in d.samples if s.index == completion.index]
        assert [t for s in mine for t in s.token_ids] == completion.token_ids
        assert "".join(s.text for s in mine) == completion.text
        assert [p for s in mine for p in s.logprobs] == completion.logprobs
        assert [s.finish_reason for s in mine if s.finish_reason] == ["length"]


def test_a_reader_that_stops_reading_has_its_request_aborted_and_what_waited_let_go(tiny_model_untied):
    """--max-stream-backlog: the engine never waits for a reader, and the server does not hold a paused reader's
    output without bound: past the bound the request ends (its blocks free), and the reader gets an error."""
    from minipaged.serve.protocol import ServerError

    engine = Engine(tiny_model_untied, block_size=4, num_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, n=2, logprobs=2)

    async def main() -> tuple[BaseException, int, object]:
        async_engine = AsyncEngine(engine, max_stream_backlog=60)   # 2 samples x (1 token + 3 entries) a step
        async_engine.start(asyncio.get_running_loop())
        updates = async_engine.generate("r1", [3, 4, 5, 6, 7], params, num_samples=2)
        try:
            assert isinstance(await updates.__anext__(), Accepted)
            deadline = time.monotonic() + 30
            while "r1" in async_engine._streams:          # the reader sleeps; the engine goes on without it
                assert time.monotonic() < deadline, "the request was never ended"
                await asyncio.sleep(0.01)
            left = updates.ag_frame.f_locals["q"].qsize()
            try:
                await updates.__anext__()
            except ServerError as exc:
                error = exc
            while engine.has_unfinished_requests():
                assert time.monotonic() < deadline, "the aborted request still runs"
                await asyncio.sleep(0.01)
        finally:
            await asyncio.to_thread(async_engine.stop, 10.0)
        return error, left, engine.stats()

    error, left, stats = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert error.status == 503 and "--max-stream-backlog" in str(error.body()), error.body()
    assert left == 1, "what the reader left unread was kept"                   # only the error waits
    assert stats["blocks_used"] == 0 and stats["generation_tokens"] < 2 * 200, stats       # ended early, freed
