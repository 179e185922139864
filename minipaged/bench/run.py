"""Drive an engine through a list of benchmark requests, keeping every step's event.

The benchmarks step the engine themselves (rather than calling ``generate``) so that they can show a progress
bar and keep the ``StepEvent`` of each step: the latency bench splits time into prefill and decode from them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from .requests import BenchRequest

if TYPE_CHECKING:
    from ..engine import Engine
    from ..events import StepEvent
    from ..outputs import RequestOutput


@dataclass
class EngineRun:
    seconds: float
    outputs: list["RequestOutput"]
    events: list["StepEvent"] = field(default_factory=list)

    @property
    def num_input_tokens(self) -> int:
        return sum(len(o.prompt_token_ids) for o in self.outputs)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


def run_requests(engine: "Engine", requests: list[BenchRequest],
                 on_progress: Optional[Callable[[int, int], None]] = None) -> EngineRun:
    """Queue every request at once (an offline batch) and step until all are done.

    ``ignore_eos`` makes each request produce exactly its ``output_len`` tokens, so token counts are exact.
    ``on_progress`` hears, after each step, how many requests finished and how many tokens were generated.
    """
    from ..request import SamplingParams
    ids: list[str] = []
    finished: dict[str, "RequestOutput"] = {}
    events = []
    start = time.perf_counter()
    try:
        for r in requests:      # a prompt the engine refuses (too long) stops the run with the ones before it
            ids.append(engine.add_request(r.prompt_token_ids, SamplingParams(temperature=0, max_tokens=r.output_len,
                                                                             ignore_eos=True)))
        while engine.has_unfinished_requests():
            result = engine.step()
            events.append(result.event)
            done = [d.output for d in result.outputs if d.output is not None]
            finished.update((o.request_id, o) for o in done)
            if on_progress is not None:
                on_progress(len(done), sum(len(s.token_ids) for d in result.outputs for s in d.samples))
    except BaseException:
        for rid in set(ids) - finished.keys():          # leave the engine clean: no leaked KV blocks
            engine.abort(rid)
        raise
    return EngineRun(time.perf_counter() - start, [finished[rid] for rid in ids], events)


def warm_up(engine: "Engine") -> None:
    """One short request first, so one-time costs (allocations, lazy imports) stay out of the measurement."""
    run_requests(engine, [BenchRequest([5, 6, 7, 8], 2)])
    engine.reset_prefix_cache()


def drive(engine: "Engine", arrivals: list[tuple[int, list[int], object]]) -> tuple[dict, list, dict]:
    """Step the engine, adding each (step, prompt, params) when its step comes.

    Arrivals are counted in engine steps, so every configuration sees the same arrival pattern.
    Returns the outputs, the events, and for each request its time to first token counted in steps.
    """
    pending = sorted(arrivals, key=lambda a: a[0])
    ids: list[str] = []
    arrived_at: dict[str, int] = {}
    ttft_steps: dict[str, int] = {}
    events = []
    outputs = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, prompt, params = pending.pop(0)
            ids.append(engine.add_request(prompt, params))
            arrived_at[ids[-1]] = step
        result = engine.step()
        events.append(result.event)
        for delta in result.outputs:
            if any(sample.token_ids for sample in delta.samples):
                ttft_steps.setdefault(delta.request_id, step + 1 - arrived_at[delta.request_id])
            if delta.output is not None:
                outputs[delta.request_id] = delta.output
        step += 1
    return {rid: outputs[rid] for rid in ids}, events, ttft_steps
