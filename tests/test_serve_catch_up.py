"""A stream that falls behind the engine catches up: the steps it missed reach it as one delta (vLLM's output
collector merges a slow consumer's outputs the same way), so a busy server writes fewer, larger chunks instead
of falling further behind, and the client gets exactly the same tokens, text and log-probabilities."""
from __future__ import annotations

import asyncio
import threading

from minipaged import Engine
from minipaged.outputs import RequestDelta, SampleDelta
from minipaged.request import SamplingParams
from minipaged.serve.async_engine import Accepted, AsyncEngine

MAX_TOKENS = 24


def test_merging_two_deltas_keeps_the_first_prompt_logprobs_and_the_last_finish():
    first = RequestDelta("r", (SampleDelta(0, "a", (1,), ({1: None},)), SampleDelta(1, "x", (7,))),
                         prompt_logprobs=[None])
    later = RequestDelta("r", (SampleDelta(1, "y", (8,), (), "length"),))
    both = first.followed_by(later)
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
