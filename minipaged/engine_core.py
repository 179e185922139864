"""The engine core: requests in as token ids and sampling parameters, one ``EngineCoreOutputs`` out per step
(vLLM v1's ``EngineCore``). It knows nothing of text, clients or observers.

    step():  scheduler.schedule()            who runs, how many tokens each, which blocks (SchedulerOutput)
             runner: swap blocks, then executor.execute_model(plan) -> ModelRunnerOutput (one object)
             scheduler.update_from_output()   the one writer of request state: tokens appended, requests ended
             speculator.propose()             (speculative decoding) guesses for the next step

The front end (``engine.py``: input and output processors) sends requests in with ``add_request`` and ends
them with ``finish_requests`` (a stop string it found in the text, an abort); both reach the scheduler's one
way a request ends. Per-request state of the forward pass is dropped by the executor on the next scheduler
output's ``finished_req_ids`` (or, when the engine goes idle, at once: ``drop_finished_state``).

Async output processing (``async_output_processing=True``, vLLM v0's name for it): ``step()`` starts step N's
forward pass in a model thread and returns step N-1's outputs at once, so that the front end turns them into
text, stop strings, deltas and the event while N computes. The next ``step()`` joins N, accounts for it and
schedules N+1 (scheduling waits for the join: nothing allocates blocks meanwhile; the front end may free some,
ending requests). A stop string found in N-1's text ends a request that N is computing a token for:
``update_from_output`` skips it, as if never generated.
On a CPU the compiled decode call and torch's ops let go of Python's GIL, so the two threads overlap; what it
can win is bounded by the model's GIL-free time, which is why it is off by default
(``bench/async_output_processing.py``). vLLM v1's async scheduling goes further: it schedules N+1 before N's tokens
are known.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from .request import RequestStatus
from .stats import EngineCounters

if TYPE_CHECKING:                      # the builder hands every part in: the core imports none of them
    from .config import EngineConfig
    from .kv_cache_manager import KVCacheManager
    from .logits.stage import GrammarJob, LogitsStage
    from .request import Request
    from .runner.executor import ModelExecutor
    from .runner.outputs import ModelRunnerOutput
    from .scheduler import Scheduler, SchedulerOutput
    from .spec_decode.speculator import Speculator
    from .swap import CpuBlockPool

GRAMMAR_POLL_S = 0.05     # an otherwise idle step waits this long for a grammar to finish compiling


@dataclass
class EngineCoreOutputs:
    """One step's results as the core hands them to the front end: what ran, each request's new tokens, the
    requests that ended in the core (EOS, stop ids, lengths, a failure), and the forward pass's output."""

    scheduler_output: Optional[SchedulerOutput] = None
    new_token_ids: dict[str, list[int]] = field(default_factory=dict)
    finished: list[Request] = field(default_factory=list)
    runner_output: Optional[ModelRunnerOutput] = None
    wait_s: float = 0.0       # async output processing: how long step() waited for the forward pass in flight
    draft_s: float = 0.0      # speculative decoding: the time spent proposing the next step's drafts


@dataclass
class InFlight:
    """The step whose forward pass runs in the model thread now (async output processing)."""

    plan: SchedulerOutput
    future: Future


class EngineCore:
    def __init__(self, config: EngineConfig, scheduler: Scheduler, kv: KVCacheManager, cpu_pool: CpuBlockPool,
                 executor: ModelExecutor, logits: LogitsStage, speculator: Optional[Speculator],
                 cpu_kv_cache: Any, thread_setup: Any) -> None:
        self.config, self.scheduler, self.kv, self.cpu_pool = config, scheduler, kv, cpu_pool
        self.executor, self.logits, self.speculator = executor, logits, speculator
        self.runner = executor.runner
        self.cpu_kv_cache = cpu_kv_cache
        self._thread_setup = thread_setup          # makes the model thread use the engine's device
        self._pool: Optional[ThreadPoolExecutor] = None
        self._in_flight: Optional[InFlight] = None
        self._ended: list[Request] = []            # ended in the core between steps (a grammar failed)
        self.counters = EngineCounters()           # running totals (steps, tokens, preemptions, seconds ...)

    # ------------------------------------------------------------------ requests in, requests ended
    def add_request(self, req: Request, grammar: Optional[GrammarJob]) -> None:
        """Queue a request (after its grammar compiles, when it has one). An id used again before its last
        owner's state was dropped: the forward pass in flight ends first (it may be dropping that state, or using
        it), then what is still there is dropped now, so that the new owner's state is never dropped for it."""
        rid = req.request_id
        if self._in_flight is not None and rid in self._in_flight.plan.finished_req_ids:
            self._wait_for_model()
        if rid in self.scheduler.finished_req_ids:
            self._wait_for_model()
            self.executor.forget({rid})
            self.scheduler.finished_req_ids.discard(rid)
        if self.logits.add(req, grammar):          # False: it waits for its grammar to compile
            self._queue_or_fail(req)

    def _queue_or_fail(self, req: Request) -> None:
        if req.error is None:
            self.scheduler.add(req)
        else:                                      # preparing its processors (its grammar) failed
            self._ended += self.scheduler.finish_requests([req], RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, reqs: list[Request], status: RequestStatus,
                        stop_reason: Optional[str] = None) -> list[Request]:
        """End requests from the front end (a stop string, an abort); returns those that were still running."""
        return self.scheduler.finish_requests(reqs, status, stop_reason)

    def has_unfinished_requests(self) -> bool:
        """Work left: a request waits, runs or is swapped out; a forward pass is in flight; or a request that
        ended in the core between steps (its grammar failed) still has to be handed to the front end."""
        return (self.scheduler.has_unfinished() or self.logits.has_waiting() or self._in_flight is not None
                or bool(self._ended))

    def drop_finished_state(self) -> None:
        """Idle, with nothing in flight: drop the ended requests' per-request state now rather than at a next
        step that may not come (vLLM v1 runs an empty step for them instead)."""
        if not self.has_unfinished_requests() and self.scheduler.finished_req_ids:
            self.executor.forget(self.scheduler.finished_req_ids)
            self.scheduler.finished_req_ids = set()

    def stats(self) -> dict[str, float]:
        """Gauges (blocks, queues, prefix-cache hit rate) and running totals."""
        return {**self.counters.snapshot(self.kv, self.cpu_pool, self.scheduler),
                **getattr(self.runner, "counters", {"communication_seconds": 0.0})}

    # ------------------------------------------------------------------ one step
    def step(self) -> EngineCoreOutputs:
        outputs = self._step_async() if self.config.async_output_processing else self._step()
        out = outputs.runner_output
        self.counters.count_step(outputs.scheduler_output, sum(map(len, outputs.new_token_ids.values())),
                                 out.times.model_s if out else 0.0, 0.0, out.verified if out else {})
        return outputs

    def _step(self) -> EngineCoreOutputs:
        plan = self._schedule()
        outputs = self._update(plan, self.executor.execute_model(plan))
        outputs.finished[:0] = self._take_ended() + plan.failed
        if self.speculator is not None:                    # guesses for the next step
            outputs.draft_s = self.speculator.propose([c.request for c in plan.chunks
                                                       if c.request.request_id in outputs.new_token_ids])
        return outputs

    def _schedule(self) -> SchedulerOutput:
        # Requests whose grammar compiled (or failed) meanwhile; with nothing else to run, wait a moment for one.
        for req in self.logits.grammars_ready(wait_s=0.0 if self.scheduler.has_unfinished() else GRAMMAR_POLL_S):
            self._queue_or_fail(req)
        plan = self.scheduler.schedule()                   # who runs, how many tokens, which blocks
        self.runner.swap_blocks(self.cpu_kv_cache, plan.swap_out, plan.swap_in)   # before the model reads them
        return plan

    def _update(self, plan: SchedulerOutput, runner_output: ModelRunnerOutput, wait_s: float = 0.0
                ) -> EngineCoreOutputs:
        """The forward pass is over: append its tokens (finishing on EOS, stop ids, length)."""
        update = self.scheduler.update_from_output(plan, runner_output.sampled)
        return EngineCoreOutputs(plan, update.new_token_ids, update.finished, runner_output, wait_s)

    def _take_ended(self) -> list[Request]:
        ended, self._ended = self._ended, []
        return ended

    # ------------------------------------------------------------------ one step, async output processing
    def _step_async(self) -> EngineCoreOutputs:
        """Join step N-1's forward pass and account for it, schedule step N and start its forward pass in the
        model thread, and return N-1's outputs while N runs (the first call has none)."""
        outputs = self._join() or EngineCoreOutputs()
        plan = self._schedule()                            # after the join: nothing else touches blocks meanwhile
        if plan.chunks:
            self._in_flight = InFlight(plan, self._launch(plan))
        else:                                              # nothing to compute: drop the ended ones' state now
            self.executor.forget(plan.finished_req_ids)
        outputs.finished[:0] = self._take_ended() + plan.failed
        return outputs

    def _launch(self, plan: SchedulerOutput) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minipaged-model",
                                            initializer=self._thread_setup)
        return self._pool.submit(self.executor.execute_model, plan)

    def _join(self) -> Optional[EngineCoreOutputs]:
        """Wait for the forward pass in flight (if any) and account for it."""
        if self._in_flight is None:
            return None
        waited = time.perf_counter()
        in_flight, self._in_flight = self._in_flight, None
        runner_output = in_flight.future.result()
        return self._update(in_flight.plan, runner_output, time.perf_counter() - waited)

    def _wait_for_model(self) -> None:
        """Let the forward pass in flight end (its result stays for the join)."""
        if self._in_flight is not None:
            self._in_flight.future.exception()             # waits; the join raises whatever it raised

    def close(self) -> None:
        """Stop the model thread (after the forward pass in flight) and the runner's workers."""
        self._wait_for_model()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.runner.close()
