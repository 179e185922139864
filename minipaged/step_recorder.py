"""The observers' window: one ``StepEvent`` per step, built outside the engine core from what the core returned
(``EngineCoreOutputs``), what the front end made of it (text, finishes) and the block pool's change log.

The core does not import this module or the event schema; the engine composes them. Subscribers (the TUI,
traces, metrics, the server's watchers) get every event; one that raises never takes the engine down.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from .events import Preemption, RequestArrival, RequestFinish, ScheduledRequest, StepEvent, prompt_preview
from .request_names import RequestNames
from .kv_recorder import KVRecorder

if TYPE_CHECKING:
    from .engine_core import EngineCore, EngineCoreOutputs
    from .output_processor import DrainedStep, RequestState
    from .request import Request
    from .runner.outputs import StepTimes
    from .scheduler import ScheduledChunk
    from .spec_decode.rejection_sampler import Verified

logger = logging.getLogger("minipaged")


class StepRecorder:
    """Keeps what happened between steps (arrivals, finishes) and turns each step into its event."""

    def __init__(self, core: EngineCore, config: Any, vocab_size: int, decode: Callable[[list[int]], str]) -> None:
        self.core, self.config, self.vocab_size, self.decode = core, config, vocab_size, decode
        self.kv = KVRecorder(core.kv.num_blocks, core.kv.block_size)   # block changes, KV events, miss reasons
        self.subscribers: list[Callable[[StepEvent], None]] = []
        self.start_time = time.perf_counter()
        self._step_index = 0
        self._arrivals: list[RequestArrival] = []    # what happened between steps goes in the next event
        self._finishes: list[RequestFinish] = []
        self.names = RequestNames()                  # one name per request, the same in every view

    def arrive(self, requests: list[Request], prompt_text: str) -> None:
        """A prompt's requests were queued (n samples: the prompt's text goes out once, with the first)."""
        preview, first = prompt_preview(prompt_text), requests[0].request_id    # bounded: every watcher gets it
        for req in requests:
            shared = req.request_id != first
            self._arrivals.append(RequestArrival(req.request_id, req.num_prompt_tokens, req.params.max_tokens,
                                                 "" if shared else preview, req.arrival_time - self.start_time,
                                                 prompt_of=first if shared else None,
                                                 name=self.names.give(req.request_id)))

    def finish(self, state: RequestState) -> None:
        """A sample ended (its output state, as the front end kept it): its record goes in the next event."""
        req, times = state.request, state.token_times
        self.kv.lookups.pop(req.request_id, None)          # looked up, never admitted: nothing will take it
        self.names.finished(req.request_id)
        itls = [b - a for a, b in zip(times, times[1:])]
        self._finishes.append(RequestFinish(
            req.request_id, state.finish_reason, req.num_prompt_tokens, len(state.token_ids),
            max(req.num_cached_tokens, 0), None if not times else times[0] - req.arrival_time,
            (state.finished_time or 0.0) - req.arrival_time, sum(itls) / len(itls) if itls else None))

    def record(self, core_out: EngineCoreOutputs, drained: DrainedStep, start: float) -> StepEvent:
        """Build the step's event (its time includes building it: taken last, written in after) and hand it to
        every subscriber."""
        plan, out = core_out.scheduler_output, core_out.runner_output
        verified: dict[str, Verified] = out.verified if out is not None else {}
        times = out.times if out is not None else None
        self._step_index += 1
        arrivals, self._arrivals = self._arrivals, []
        finishes, self._finishes = self._finishes, []
        kv, lookups = self.kv.fold(self.core.kv.take_log())
        s, stats = self.core.scheduler, self.core.stats()
        chunks = plan.chunks if plan is not None else []
        event = StepEvent(
            step=self._step_index, time_s=0.0, duration_s=0.0, schedule_s=0.0,
            model_s=times.model_s if times else 0.0, draft_s=core_out.draft_s,
            budget_limit=self.config.max_num_batched_tokens, budget_used=plan.num_batched_tokens if plan else 0,
            max_num_seqs=self.config.max_num_seqs, arrivals=tuple(arrivals),
            preempted=tuple(Preemption(p.request.request_id, p.mode, p.num_blocks,
                                       "not enough free KV blocks for a running request")
                            for p in (plan.preempted if plan is not None else ())),
            scheduled=tuple(self._scheduled(c, verified.get(c.request.request_id), lookups) for c in chunks),
            swapped_in=tuple(r.request_id for r in plan.swapped_in) if plan is not None else (),
            finished=tuple(finishes), new_token_ids=drained.token_ids, new_text=drained.text, kv=kv,
            num_free_blocks=stats["blocks_free"], num_cached_free_blocks=stats["blocks_cached_free"],
            num_total_blocks=stats["blocks_total"], num_free_cpu_blocks=stats["cpu_blocks_free"],
            num_total_cpu_blocks=stats["cpu_blocks_total"],
            waiting=tuple(r.request_id for r in s.waiting), running=tuple(r.request_id for r in s.running),
            swapped=tuple(r.request_id for r in s.swapped), counters=stats, new_logprobs=drained.logprobs,
            constrained={rid: (allowed, self.vocab_size) for rid, allowed in (out.constrained if out else {}).items()})
        end = time.perf_counter()
        stats["step_seconds"] = self.core.counters.add_step_seconds(end - start)
        # The host's share: without async output processing all but the forward pass; with it, all but the wait
        # for it (the forward pass ran in the model thread, beside the host's work).
        async_on = self.config.async_output_processing
        schedule_s = (end - start) - (core_out.wait_s if async_on else event.model_s + event.draft_s)
        event = dataclasses.replace(event, time_s=end - self.start_time, duration_s=end - start,
                                    schedule_s=schedule_s,
                                    **host_and_forward(times, end - start, core_out.wait_s, event.draft_s, async_on))
        for callback in list(self.subscribers):
            try:
                callback(event)
            except Exception:                         # an observer must never take the engine down
                logger.exception("a StepEvent subscriber raised; it stays subscribed")
        return event

    def _scheduled(self, chunk: ScheduledChunk, verdict: Optional[Verified], lookups: dict) -> ScheduledRequest:
        """The event's record of one chunk (never the live request: an event is frozen, serialised, replayed);
        a verified decode also says what was guessed and kept, as text."""
        req = chunk.request
        record = ScheduledRequest(req.request_id, chunk.kind, chunk.start, chunk.end, req.num_prompt_tokens,
                                  chunk.num_cached_tokens, len(req.output_token_ids),
                                  prefix_lookup=lookups.pop(req.request_id, None) if chunk.admitted else None,
                                  spec_k=req.spec_k, spec_acceptance=req.spec_acceptance)
        if verdict is None:
            return record
        return dataclasses.replace(record, draft_token_ids=chunk.spec_token_ids, num_accepted=verdict.num_accepted,
                                   draft_pieces=tuple(self.decode([t]) for t in chunk.spec_token_ids),
                                   target_piece=self.decode(verdict.token_ids[-1:]))


def host_and_forward(times: Optional[StepTimes], duration_s: float, wait_s: float, draft_s: float,
                     async_on: bool) -> dict[str, Optional[float]]:
    """StepEvent's host_s, forward_s and device_s (rounded to the microsecond: every watcher gets them).

    Without async output processing the step is host work, then the forward pass, then host work again:
    host_s + forward_s (+ a draft model's draft_s) = duration_s. With it, the forward pass ran in the model
    thread beside the host's work, so the two may add up to more than the step: the host's work is this
    ``step()``'s time but its wait for the model thread, plus what the model thread did outside the forward
    (the batch's tensors, the logits stage, sampling)."""
    prepare_s, model_s, forward_s = (times.prepare_s, times.model_s, times.forward_s) if times else (0.0, 0.0, 0.0)
    if async_on:
        host_s = duration_s - wait_s + prepare_s + model_s - forward_s
    else:
        host_s = duration_s - forward_s - draft_s
    device_s = None if times is None or times.device_s is None else round(times.device_s, 6)
    return {"host_s": round(max(host_s, 0.0), 6), "forward_s": round(forward_s, 6), "device_s": device_s}
