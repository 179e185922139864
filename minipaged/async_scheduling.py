"""Async output processing (vLLM v0's, not vLLM v1's ``--async-scheduling``): the host's work hides behind the
model's; scheduling still waits for the forward pass (lessons/lesson10_gpu_waits.md says how v1 differs).

Without it a step does everything in turn: schedule, run the model, then turn the new tokens into text,
find stop strings, build the deltas and the StepEvent. The model waits for the host and the host for the
model. With it, ``Engine.step()`` starts step N's forward pass in a *model thread* and, while it runs, the
engine thread processes step N-1's outputs (detokenization, stop strings, deltas, N-1's StepEvent), then
returns them: one step late. The next ``step()`` waits for N's forward pass (the join), accounts for its
tokens (``Scheduler.update_from_output``), schedules N+1 and starts it, and processes N's outputs. On a CPU
the compiled decode call and torch's ops let go of Python's GIL, so the two threads really overlap; on CUDA
the launches are asynchronous anyway.

What only the text can tell comes one step late, and that is the hard part: a stop string found in N-1's
text ends a request that step N is already computing a token for. That token is dropped as if it was never
generated: ``update_from_output`` skips a request that finished while its forward pass was in flight, and its
blocks were freed when the stop string was found (nothing reuses them before the join: scheduling waits for
it). Aborts between steps are the same case. Everything the model thread touches is left alone until the
join: the sampler's and the logits stage's per-request state is forgotten then (``Engine._forget``), and the
prompt log-probabilities it computes wait in a ``PromptLogprobsBuffer``.

Each step's KV changes still reach observers in order, and an event's block map equals the block manager's
when it is emitted: the event of step N-1 carries every block change up to that moment, which includes the
blocks allocated for step N (in flight). Its ``scheduled`` records are step N-1's.

What it can win is bounded by Python's GIL: the two threads' Python runs one at a time, so only the model's
GIL-free time (compiled calls, torch's kernels, waiting for a GPU) can hide the host's work. On a CPU with a
tiny model the forward pass is mostly Python; with a real model the host's share of a step is small. That is
why it is off by default; ``bench/async_output_processing.py`` measures wall time and each thread's CPU time.

Speculative decoding proposes from the tokens of the step just verified and would need them a step early:
``EngineConfig.validate`` refuses it with async output processing on (and parallel ranks, not built for it yet).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional, TypeVar

import torch

from .kernels.devices import use_in_this_thread
from .execute_step import StepTimes
from .logits.logprobs import TokenLogprobs
from .output_processor import OutputProcessor
from .request import Request
from .scheduler import SchedulerOutput, StepUpdate
from .spec_decode.rejection_sampler import Verified

T = TypeVar("T")


@dataclass
class StepOutcome:
    """A finished forward pass, accounted for: what the engine thread turns into outputs and a StepEvent."""

    plan: SchedulerOutput = field(default_factory=SchedulerOutput)
    update: StepUpdate = field(default_factory=StepUpdate)
    verified: dict[str, Verified] = field(default_factory=dict)
    times: StepTimes = field(default_factory=StepTimes)      # input preparation, forward pass, sampling
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    constrained: dict[str, int] = field(default_factory=dict)


class PromptLogprobsBuffer:
    """Stands in for the OutputProcessor in the model thread: the prompt log-probabilities a forward pass
    scores wait here until the join, so the output processor is only ever touched by the engine thread."""

    def __init__(self) -> None:
        self.entries: list[tuple[Request, int, list[TokenLogprobs]]] = []

    def record_prompt_logprobs(self, req: Request, first: int, entries: list[TokenLogprobs]) -> None:
        self.entries.append((req, first, entries))

    def replay(self, outputs: OutputProcessor) -> None:
        for req, first, entries in self.entries:
            if not req.is_finished:                  # aborted meanwhile: its output state is gone
                outputs.record_prompt_logprobs(req, first, entries)


@dataclass
class InFlight:
    """The step whose forward pass runs in the model thread now."""

    plan: SchedulerOutput
    future: Future
    prompt_logprobs: PromptLogprobsBuffer


class ModelThread:
    """One thread that runs forward passes, one at a time, started on first use on the engine's device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool: Optional[ThreadPoolExecutor] = None

    def launch(self, fn: Callable[[], T]) -> "Future[T]":
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minipaged-model",
                                            initializer=use_in_this_thread, initargs=(self.device,))
        return self._pool.submit(fn)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
