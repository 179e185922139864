"""When the server's engine thread hands its tokens to the event loop (``AsyncEngine``, through the engine's
``before_model_call`` hook).

Python runs one thread at a time. If the event loop woke between two of the engine thread's calls, the engine
would wait for the loop's Python (streaming a token) before its next call, on every token. So a step's tokens
wait in an outbox until the next step's long compiled call is about to release the GIL; a backend without such a
call gets them after each step. Either way every token arrives, in order, and a request's last ones at once.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from typing import Callable

import pytest

from minipaged import Engine
from minipaged.events import StepEvent
from minipaged.request import SamplingParams
from minipaged.outputs import RequestDelta
from minipaged.serve.async_engine import AsyncEngine

MAX_TOKENS = 6


class _NotedQueue(queue.SimpleQueue):
    """The AsyncEngine's queue of outboxes for its courier, noting (inside a hand-off?, steps ended) for each
    outbox the engine thread puts on it."""

    def __init__(self, inside_hand_off: list[bool], steps: list[int], noted: list[tuple[bool, int]]) -> None:
        super().__init__()
        self.inside_hand_off, self.steps, self.noted = inside_hand_off, steps, noted

    def put(self, item, block=True, timeout=None):
        if item is not None:
            assert threading.current_thread().name == "minipaged-engine"
            self.noted.append((self.inside_hand_off[0], self.steps[0]))
        super().put(item, block, timeout)


def serve_one_request(engine: Engine, in_loop: Callable[[StepEvent], None] = lambda _event: None,
                      on_update: Callable[[RequestDelta], None] = lambda _update: None,
                      hand_off_at_model_call: bool = True) -> tuple[list[int], list[tuple[bool, int]]]:
    """Stream one request through an AsyncEngine; its tokens, and for every outbox the engine thread handed over
    (each wakes the event loop once): (was it inside a hand-off, how many steps had ended). ``in_loop`` is
    subscribed on the event loop; ``on_update`` sees each RequestDelta as the request gets it."""
    inside_hand_off = [False]
    # Hooks run in the order they were added: the AsyncEngine's hand-off runs between these two.
    engine.before_model_call(lambda: inside_hand_off.__setitem__(0, True))
    async_engine = AsyncEngine(engine, hand_off_at_model_call=hand_off_at_model_call)
    engine.before_model_call(lambda: inside_hand_off.__setitem__(0, False))
    async_engine.subscribe_in_loop(in_loop)
    steps = [0]
    engine.subscribe(lambda _event: steps.__setitem__(0, steps[0] + 1))
    handed_over: list[tuple[bool, int]] = []
    async_engine._batches = _NotedQueue(inside_hand_off, steps, handed_over)
    served: list[tuple[bool, int]] = []

    waking_threads: set[str] = set()

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        call_soon_threadsafe = loop.call_soon_threadsafe

        def noted_call(*args):                 # (a wake-up writes to a socket: a system call, which lets go of the GIL)
            waking_threads.add(threading.current_thread().name)
            return call_soon_threadsafe(*args)
        loop.call_soon_threadsafe = noted_call
        async_engine.start(loop)
        tokens: list[int] = []
        try:
            params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
            async for item in async_engine.generate("r1", lambda _engine: ([3, 4, 5, 6, 7], params)):
                if isinstance(item, RequestDelta):
                    on_update(item)
                    tokens.extend(t for delta in item.samples for t in delta.token_ids)
                    if item.output is not None:
                        assert tokens == list(item.output.outputs[0].token_ids)
                        served.extend(handed_over)              # (stopping hands over once more)
        finally:
            await asyncio.to_thread(async_engine.stop, 10.0)
        assert not async_engine._courier.is_alive()
        return tokens
    tokens = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert "minipaged-courier" in waking_threads and "minipaged-engine" not in waking_threads, waking_threads
    return tokens, served


def test_tokens_go_to_the_event_loop_inside_the_next_steps_hand_off(tiny_model_untied):
    """The cpu backend's decode steps are one compiled call: each step's tokens go to the loop once, from inside
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


@pytest.mark.parametrize("backend, hand_off_at_model_call", [("torch", True), ("cpu", False)],
                         ids=["torch-backend", "serve-hand-off-step-end"])
def test_a_backend_without_a_hand_off_gets_its_tokens_handed_over_after_each_step(tiny_model_untied, backend,
                                                                                   hand_off_at_model_call):
    """The torch backend never runs the model-call hook, and ``minipaged serve --hand-off step-end`` does not use
    the cpu backend's: every step's tokens go to the loop when the step ends."""
    engine = Engine(tiny_model_untied, block_size=4, num_blocks=64, attention_backend=backend)
    tokens, wake_ups = serve_one_request(engine, hand_off_at_model_call=hand_off_at_model_call)
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


def test_a_stopped_server_takes_its_hook_and_subscription_away(tiny_model_untied):
    """The engine may be driven directly again (``Engine.generate``) once its server has stopped: neither the
    server's model-call hook nor its event subscriber runs any more."""
    engine = Engine(tiny_model_untied, block_size=4, num_blocks=64)
    async_engine = AsyncEngine(engine)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.generate([[3, 4, 5]], params)
    assert async_engine._handed_off and async_engine._view.step > 0     # hooked in and watching
    async_engine.stop()
    async_engine._handed_off, steps_seen = False, async_engine._view.step
    engine.generate([[3, 4, 5]], params)
    assert not async_engine._handed_off and async_engine._view.step == steps_seen


def test_a_loop_subscriber_sees_each_step_on_the_event_loop_before_its_tokens_arrive(tiny_model_untied):
    """``subscribe_in_loop`` (the server's metrics): called on the event loop's thread for every step, and for a
    step that gave the request tokens, before the request gets them (a client that got its answer finds it
    counted)."""
    engine = Engine(tiny_model_untied, block_size=4, num_blocks=64)
    seen: list[tuple[str, int]] = []                  # (thread, tokens of r1 counted so far)
    counted = [0]

    def in_loop(event: StepEvent) -> None:
        counted[0] += len(event.new_token_ids.get("r1", ()))
        seen.append((threading.current_thread().name, counted[0]))
    received = [0]

    def on_update(update: RequestDelta) -> None:
        received[0] += sum(len(d.token_ids) for d in update.samples)
        assert counted[0] >= received[0]              # counted before it arrived
    tokens, _ = serve_one_request(engine, in_loop, on_update)
    assert len(tokens) == MAX_TOKENS and counted[0] == MAX_TOKENS
    assert {thread for thread, _ in seen} == {threading.main_thread().name}   # asyncio.run's loop thread
