"""When the server's engine thread hands its tokens to the event loop (``AsyncEngine``, ``Backend.hand_off``).

Python runs one thread at a time. If the event loop woke between two of the engine thread's calls, the engine
would wait for the loop's Python (streaming a token) before its next call, on every token. So a step's tokens
wait in an outbox until the next step's long compiled call is about to release the GIL; a backend without such a
call gets them after each step. Either way every token arrives, in order, and a request's last ones at once.
"""
from __future__ import annotations

import asyncio
import threading

import pytest

from minipaged import Engine
from minipaged.request import SamplingParams
from minipaged.serve.async_engine import AsyncEngine, Update

MAX_TOKENS = 6


def serve_one_request(engine: Engine) -> tuple[list[int], list[tuple[bool, int]]]:
    """Stream one request through an AsyncEngine; its tokens, and for every wake-up of the event loop by the engine
    thread: (was it inside a hand-off, how many steps had ended)."""
    async_engine = AsyncEngine(engine)
    inside_hand_off = [False]
    steps = [0]
    engine.subscribe(lambda _event: steps.__setitem__(0, steps[0] + 1))
    hand_off = engine.backend.hand_off

    def noted_hand_off() -> None:
        inside_hand_off[0] = True
        try:
            hand_off()
        finally:
            inside_hand_off[0] = False
    engine.backend.hand_off = noted_hand_off
    wake_ups: list[tuple[bool, int]] = []
    served: list[tuple[bool, int]] = []

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        call_soon_threadsafe = loop.call_soon_threadsafe

        def noted_call(*args):
            if threading.current_thread().name == "minipaged-engine":     # (not asyncio's own threads)
                wake_ups.append((inside_hand_off[0], steps[0]))
            return call_soon_threadsafe(*args)
        loop.call_soon_threadsafe = noted_call
        async_engine.start(loop)
        tokens: list[int] = []
        try:
            params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
            async for item in async_engine.generate("r1", lambda _engine: ([3, 4, 5, 6, 7], params)):
                if isinstance(item, Update):
                    tokens.extend(t for delta in item.deltas for t in delta.token_ids)
                    if item.output is not None:
                        assert tokens == list(item.output.outputs[0].token_ids)
                        served.extend(wake_ups)                 # (stopping wakes the loop once more)
        finally:
            await asyncio.to_thread(async_engine.stop, 10.0)
        return tokens
    tokens = asyncio.run(asyncio.wait_for(main(), timeout=60))
    return tokens, served


def test_tokens_go_to_the_event_loop_inside_the_next_steps_hand_off(tiny_model_untied):
    """The cpu backend's decode steps are one compiled call: each step's tokens wake the loop once, from inside
    the next step's hand-off; the last step's (nothing follows it) at once, after it."""
    engine = Engine(tiny_model_untied, block_size=4, num_blocks=64)
    assert engine.backend._decode_layers is not None
    tokens, wake_ups = serve_one_request(engine)
    assert len(tokens) == MAX_TOKENS
    # the request's acceptance (before any step), then one wake-up per step: MAX_TOKENS steps (a prefill, decodes)
    assert len(wake_ups) == 1 + MAX_TOKENS, wake_ups
    inside = [was_inside for was_inside, _ in wake_ups]
    assert inside[1:-1] == [True] * (MAX_TOKENS - 1), wake_ups     # step N's tokens, inside step N+1's hand-off
    assert inside[-1] is False and wake_ups[-1][1] == MAX_TOKENS    # the last tokens: after the last step


def test_a_backend_without_a_hand_off_gets_its_tokens_handed_over_after_each_step(tiny_model_untied):
    """The torch backend never calls ``hand_off``: every step's tokens go to the loop when the step ends."""
    engine = Engine(tiny_model_untied, block_size=4, num_blocks=64, attention_backend="torch")
    tokens, wake_ups = serve_one_request(engine)
    assert len(tokens) == MAX_TOKENS
    step_wake_ups = [(inside, steps) for inside, steps in wake_ups if steps > 0]
    assert step_wake_ups == [(False, n) for n in range(1, MAX_TOKENS + 1)], wake_ups


@pytest.mark.parametrize("backend", [None, "torch"])
def test_handed_off_tokens_equal_the_engines_own(tiny_model_untied, backend):
    """The same greedy tokens through the server's thread as from ``Engine.generate``."""
    engine = Engine(tiny_model_untied, block_size=4, num_blocks=64, attention_backend=backend)
    expected = engine.generate([[3, 4, 5, 6, 7]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                  ignore_eos=True))[0].outputs[0].token_ids
    tokens, _ = serve_one_request(engine)
    assert tokens == list(expected)


def test_a_stopped_server_gives_the_backend_its_own_hand_off_back(tiny_model_untied):
    """The engine may be driven directly again (``Engine.generate``) once its server has stopped."""
    engine = Engine(tiny_model_untied, block_size=4, num_blocks=64)
    own = engine.backend.hand_off
    async_engine = AsyncEngine(engine)
    assert engine.backend.hand_off == async_engine._hand_off
    async_engine.stop()
    assert engine.backend.hand_off is own
