"""The engine: requests in, tokens out, one ``step()`` at a time.

Follow a request from top to bottom:
  1. ``add_request``: the ``InputProcessor`` validates the prompt, tokenises it and makes a ``Request``
     (n of them for n samples); the scheduler puts it in its waiting queue (a request with structured
     outputs first waits in the logits stage while its grammar compiles in the background).
  2. ``step`` asks the ``Scheduler`` which requests run and how many tokens each computes (it allocates
     their KV blocks, using prefix-cache hits, preempting if memory runs out). Its output carries each
     request's block table.
  3. Swapped blocks are copied between the GPU and CPU pools.
  4. The ``ModelRunner`` lays all scheduled tokens end to end and runs ``CompactLlama`` once; attention
     reads and writes the paged cache through the block tables.
  5. The logits stage (``minipaged.logits``) applies each request's penalties, biases and masks (a
     structured-output grammar among them) and keeps the log-probabilities asked for; then the ``Sampler``
     picks a token for each request that reached the end of its known tokens.
  6. ``Scheduler.update_from_output`` advances ``num_computed_tokens``, appends the tokens, finishes requests
     on EOS, stop ids and lengths, and returns each one's new tokens; finished ones free their blocks at once.
  7. The ``OutputProcessor`` turns tokens into text and builds each request's delta (and its
     ``RequestOutput`` when it finishes); a stop string it finds ends its request through the scheduler
     (``finish_on_stop_string``). The engine writes no request field.
  8. With speculative decoding on, a proposer guesses each decoding request's next k tokens; the next
     step schedules them with the request's last token and the rejection sampler keeps those the target
     agrees with (``minipaged.spec_decode``).
  9. ``step`` returns a ``StepResult``: ``outputs``, the deltas clients read (the server, the CLI,
     ``generate``), and ``event``, a ``StepEvent`` recording all of it for observers (the TUI, traces,
     metrics, the web view), who also get it through ``subscribe``.
  10. With async output processing (``async_output_processing=True``, ``--async-output-processing``;
      vLLM v0's name, not v1's ``--async-scheduling``) steps 4-5 of step N (the forward pass, logits, sampling)
      run in a model thread while 7-9 of step N-1 run here; the next ``step()`` waits for them before its 6
      and 2. So ``step()`` returns step N-1's result (minipaged/async_scheduling.py).

The engine's surface: ``add_request``, ``abort``, ``step``, ``has_unfinished_requests``, ``info``, ``stats``,
``subscribe`` (observers), ``before_model_call`` (a hook at the model call), and ``generate`` / ``chat`` on top.
Its parts (``engine_builder.EngineParts``) are attributes for those who study or test them.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
import time
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from .async_scheduling import InFlight, ModelThread, PromptLogprobsBuffer, StepOutcome
from .engine_builder import build_engine_parts
from .execute_step import StepTimes, execute_and_sample
from .events import RequestArrival, RequestFinish, StepEvent, prompt_preview
from .input_processor import Prompt, ProcessedPrompt, as_prompt_list
from .output_processor import DrainedStep
from .outputs import RequestOutput, StepResult
from .request import InvalidRequestError, Request, RequestStatus, SamplingParams
from .scheduler import SchedulerOutput
from .spec_decode.rejection_sampler import Verified
from .stats import EngineCounters
from .step_records import preemption_records, scheduled_record

logger = logging.getLogger("minipaged")
GRAMMAR_POLL_S = 0.05     # an otherwise idle step waits this long for a grammar to finish compiling


class Engine:
    """A paged-KV, continuously batched inference engine for Llama-architecture models."""

    def __init__(self, model: str = "smollm2", *, load_progress: Optional[Callable[[str], None]] = None,
                 **options: Any) -> None:
        parts = build_engine_parts(model, options, load_progress)
        self.config = parts.config             # the options, checked and completed
        self.info = parts.info                 # what does not change during a run (every event's header)
        self.tokenizer = parts.tokenizer
        self.loaded = parts.loaded             # transformers' config (and model, unless quantized), EOS ids
        # The parts, in the order a step uses them (engine_builder.py says how each is chosen):
        self.inputs = parts.inputs             # requests in: validate, tokenise
        self.logits = parts.logits             # per-request logits processing (penalties, masks, grammars)
        self.scheduler = parts.scheduler       # who runs, how many tokens each
        self.kv = parts.kv                     # the block manager of the device pool (prefix cache included)
        self.cpu_pool = parts.cpu_pool         # the host pool swapped-out requests wait in
        self.runner = parts.runner             # one forward pass over the flattened batch
        self.model = parts.model
        self.backend = parts.backend           # everything specific to the device or kernels
        self.kv_cache = parts.kv_cache
        self.cpu_kv_cache = parts.cpu_kv_cache
        self.sampler = parts.sampler
        self.speculator = parts.speculator     # speculative decoding (None: off)
        self.draft_model = parts.draft_model
        self.outputs = parts.outputs           # tokens out: text, stop strings, deltas, RequestOutputs
        self.device, self.layout = parts.device, parts.layout
        self._pending_arrivals: list[RequestArrival] = []   # what happened between steps goes in the next event
        self._pending_finishes: list[RequestFinish] = []
        self._subscribers: list[Callable[[StepEvent], None]] = []
        self._model_call_hooks: list[Callable[[], None]] = []
        self._step_index = 0
        self._start_time = time.perf_counter()
        self._counters = EngineCounters()
        # Async output processing (minipaged/async_scheduling.py): the step whose forward pass runs in the model thread,
        # and the requests whose sampler and logits state waits for it to end before it is forgotten.
        self._model_thread = ModelThread(parts.device)
        self._in_flight: Optional[InFlight] = None
        self._forget_after_join: list[str] = []

    # ------------------------------------------------------------------ requests in
    def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None) -> str:
        """Validate and queue one prompt; returns its request id. Raises InvalidRequestError on bad input."""
        return self._queue(self.inputs.process(prompt, params), request_id)

    def validate_request(self, prompt: Prompt, params: Optional[SamplingParams] = None) -> None:
        """Raise InvalidRequestError if ``add_request`` would refuse this request; nothing is queued."""
        self.logits.compile(self.inputs.process(prompt, params).params)

    def _queue(self, prompt: ProcessedPrompt, request_id: Optional[str]) -> str:
        grammar = self.logits.compile(prompt.params)      # a bad schema is refused here, before anything is queued
        request_id, requests = self.inputs.make_requests(prompt, request_id, self.outputs.id_in_use)
        if any(r.request_id in self._forget_after_join for r in requests):
            self._wait_for_model()                      # an id used again: forget its last owner's state first
        self.outputs.add_requests(request_id, requests)
        preview = prompt_preview(self.inputs.prompt_text(prompt))   # bounded: every watcher gets it
        first = requests[0].request_id
        for req in requests:
            shared = req.request_id != first                  # n samples: the prompt goes out once
            self._pending_arrivals.append(RequestArrival(req.request_id, req.num_prompt_tokens,
                                                         req.params.max_tokens, "" if shared else preview,
                                                         req.arrival_time - self._start_time,
                                                         prompt_of=first if shared else None))
            if self.logits.add(req, grammar):                 # False: it waits for its grammar to compile
                self._schedule_or_fail(req)
        return request_id

    def _schedule_or_fail(self, req: Request) -> None:
        """Queue a request whose processors are ready, or finish it as aborted if preparing them failed."""
        if req.error is None:
            self.scheduler.add(req)
        else:
            self.scheduler.finish_requests([req], RequestStatus.FINISHED_ABORTED)
            self._record_finish(req, time.perf_counter())

    def abort(self, request_id: str) -> bool:
        """Stop a request (or all n samples of it) now and free its blocks; its caller gets no more outputs
        for it (the next event still shows the abort to observers). False if it is not running."""
        requests = self.outputs.unfinished(request_id)
        self.scheduler.finish_requests(requests, RequestStatus.FINISHED_ABORTED)   # O(samples), not O(samples^2)
        for req in requests:
            self._record_finish(req, time.perf_counter(), deliver=False)
        return bool(requests)

    def has_unfinished_requests(self) -> bool:
        """True while a request waits (for its grammar, too), runs or is swapped out, or (async output processing) a
        forward pass is in flight."""
        return self.scheduler.has_unfinished() or self.logits.has_waiting() or self._in_flight is not None

    def subscribe(self, callback: Callable[[StepEvent], None]) -> Callable[[], None]:
        """Call ``callback(event)`` after every step; returns a function that unsubscribes it."""
        self._subscribers.append(callback)

        def unsubscribe() -> None:                # calling it twice is harmless
            if callback in self._subscribers:
                self._subscribers.remove(callback)
        return unsubscribe

    def before_model_call(self, hook: Callable[[], None]) -> Callable[[], None]:
        """Run ``hook()`` in each step, just before the model's long call that lets go of Python's GIL, where
        the backend has one (the cpu backend's compiled decode step; the start of its other steps); on other
        backends it does not run. A server hands the previous step's outputs to its HTTP thread there, so that
        thread's Python runs while the model computes. With async output processing it does not run either: the
        model computes in its own thread while ``step()`` returns, so the caller's hand-off after the step
        already overlaps it. Returns a function that removes the hook."""
        self._model_call_hooks.append(hook)

        def remove() -> None:
            if hook in self._model_call_hooks:
                self._model_call_hooks.remove(hook)
        return remove

    def _run_model_call_hooks(self) -> None:
        for hook in list(self._model_call_hooks):
            hook()

    # ------------------------------------------------------------------ one step
    def step(self) -> StepResult:
        """One engine step: schedule, run the model once, sample, and hand out what changed (``outputs`` for
        clients, ``event`` for observers, who also get the event through ``subscribe``).

        With async output processing (``async_output_processing=True``) it starts this step's forward pass in the
        model thread and returns the previous step's outputs and event while it runs (minipaged/async_scheduling.py)."""
        if self.config.async_output_processing:
            return self._step_async()
        start = time.perf_counter()
        plan = self._schedule()
        sampled, verified, times = execute_and_sample(        # request id -> its new tokens (None: sampling failed)
            plan, self.runner, self.logits, self.sampler, self.outputs, self.speculator, self._run_model_call_hooks)
        outcome = self._account(plan, sampled, verified, times)
        result = self._process_outputs(outcome, plan.failed, start, wait_s=0.0)
        if self.speculator is not None:    # the automatic k learns what a step of so many rows costs, all of it
            self.speculator.observe_step(plan.chunks, result.event.duration_s, result.event.draft_s)
        return result

    def _schedule(self) -> SchedulerOutput:
        # Requests whose grammar compiled (or failed) meanwhile; with nothing else to run, wait a moment for one.
        for req in self.logits.grammars_ready(wait_s=0.0 if self.scheduler.has_unfinished() else GRAMMAR_POLL_S):
            self._schedule_or_fail(req)
        plan = self.scheduler.schedule()                   # who runs, how many tokens, which blocks
        for p in plan.preempted:                           # its KV is gone (or swapped): so is the draft's
            self._drop_drafts(p.request.request_id)
        self.runner.swap_blocks(self.cpu_kv_cache, plan.swap_out, plan.swap_in)   # before the model reads the cache
        return plan

    def _account(self, plan: SchedulerOutput, sampled: dict[str, Optional[list[int]]],
                 verified: dict[str, Verified], times: StepTimes) -> StepOutcome:
        """The forward pass is over: append its tokens (finishing on EOS, stop ids, length) and take what the
        logits stage kept for them."""
        update = self.scheduler.update_from_output(plan, sampled)
        return StepOutcome(plan, update, verified, times, self.logits.take_logprobs(update.new_token_ids),
                           self.logits.drain_constrained())

    def _process_outputs(self, outcome: StepOutcome, failed: list[Request], start: float,
                         wait_s: float) -> StepResult:
        """Text, stop strings, finishes, the deltas and the event of a step whose forward pass is over."""
        plan, update = outcome.plan, outcome.update
        for req, stop, surplus in self.outputs.process_tokens(update.new_token_ids, time.perf_counter(),
                                                              outcome.logprobs):
            self.scheduler.finish_on_stop_string(req, stop, surplus, update)     # a stop string, found in the text
        for req in self.outputs.take_failed():             # its text could not be made: it ends, the others go on
            if not req.is_finished:
                self.scheduler.finish_requests([req], RequestStatus.FINISHED_ABORTED)
                update.finished.append(req)
        for req in failed:                                 # a policy raised deciding about it: aborted
            self._record_finish(req, time.perf_counter())
        for req in update.finished:
            self._record_finish(req, time.perf_counter())
        drained = self.outputs.drain()                     # the step's deltas, and the same as observers see it
        draft_s = 0.0
        if self.speculator is not None:                    # guesses for the next step
            draft_s = self.speculator.propose([c.request for c in plan.chunks
                                               if c.request.request_id in update.new_token_ids])
        return StepResult(drained.deltas, self._emit(outcome, drained, start, draft_s, wait_s))

    # ------------------------------------------------------------------ one step, async output processing
    def _step_async(self) -> StepResult:
        """Join step N-1's forward pass and account for its tokens, schedule step N and start its forward pass
        in the model thread, then process N-1's outputs while N runs (the first call has none to process)."""
        start = time.perf_counter()
        outcome, wait_s = self._join()
        plan = self._schedule()                            # after the join: nothing else touches blocks meanwhile
        if plan.chunks:
            buffer = PromptLogprobsBuffer()
            self._in_flight = InFlight(plan, self._model_thread.launch(
                lambda: execute_and_sample(plan, self.runner, self.logits, self.sampler, buffer, None)), buffer)
        return self._process_outputs(outcome or StepOutcome(), plan.failed, start, wait_s)

    def _join(self) -> tuple[Optional[StepOutcome], float]:
        """Wait for the forward pass in flight (if any) and account for it; also the seconds waited."""
        if self._in_flight is None:
            return None, 0.0
        waited = time.perf_counter()
        in_flight, self._in_flight = self._in_flight, None
        try:
            sampled, verified, times = in_flight.future.result()
        finally:
            self._forget_waiting()
        in_flight.prompt_logprobs.replay(self.outputs)
        return self._account(in_flight.plan, sampled, verified, times), time.perf_counter() - waited

    def _wait_for_model(self) -> None:
        """Let the forward pass in flight end (its result stays for the join), then forget what waited for it."""
        if self._in_flight is not None:
            self._in_flight.future.exception()             # waits; the join raises whatever it raised
        self._forget_waiting()

    def _forget(self, request_id: str) -> None:
        """Drop a finished request's sampler and logits state, or, while the model thread may be using it,
        once its forward pass is over."""
        if self._in_flight is not None:
            self._forget_after_join.append(request_id)
            return
        self.sampler.forget(request_id)
        self.logits.forget(request_id)

    def _forget_waiting(self) -> None:
        waiting, self._forget_after_join = self._forget_after_join, []
        for request_id in waiting:
            self.sampler.forget(request_id)
            self.logits.forget(request_id)

    def _drop_drafts(self, request_id: str) -> None:
        if self.speculator is not None:
            self.speculator.forget(request_id)

    def _record_finish(self, req: Request, now: float, deliver: bool = True) -> None:
        self._forget(req.request_id)
        self._drop_drafts(req.request_id)
        self._counters.count_finish()
        self._pending_finishes.append(self.outputs.finish(req, now, deliver))

    def _emit(self, outcome: StepOutcome, drained: DrainedStep, start: float, draft_s: float,
              wait_s: float) -> StepEvent:
        """Count the step, build its StepEvent (its time includes building it: taken last, written in after)
        and hand it to every subscriber. ``wait_s``: the time ``step()`` waited for a forward pass in the model
        thread (async output processing), which is not the host's work."""
        plan, update, verified, times = outcome.plan, outcome.update, outcome.verified, outcome.times
        model_s = times.model_s
        new_token_ids = update.new_token_ids
        self._counters.count_step(plan, sum(map(len, new_token_ids.values())), model_s, 0.0, verified)
        self._step_index += 1
        arrivals, self._pending_arrivals = self._pending_arrivals, []
        finishes, self._pending_finishes = self._pending_finishes, []
        s, stats = self.scheduler, self.stats()
        event = StepEvent(
            step=self._step_index, time_s=0.0, duration_s=0.0, schedule_s=0.0, model_s=model_s, draft_s=draft_s,
            budget_limit=self.config.max_num_batched_tokens, budget_used=plan.num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs, arrivals=tuple(arrivals), preempted=preemption_records(plan),
            scheduled=tuple(scheduled_record(ch, verified.get(ch.request.request_id), self.tokenizer.decode)
                            for ch in plan.chunks),
            swapped_in=tuple(r.request_id for r in plan.swapped_in), finished=tuple(finishes),
            new_token_ids=new_token_ids, new_text=drained.text, kv=self.kv.drain_changes(),
            num_free_blocks=stats["blocks_free"], num_cached_free_blocks=stats["blocks_cached_free"],
            num_total_blocks=stats["blocks_total"], num_free_cpu_blocks=stats["cpu_blocks_free"],
            num_total_cpu_blocks=stats["cpu_blocks_total"],
            waiting=tuple(r.request_id for r in s.waiting), running=tuple(r.request_id for r in s.running),
            swapped=tuple(r.request_id for r in s.swapped), counters=stats,
            new_logprobs=drained.logprobs,
            constrained={rid: (allowed, self.logits.vocab_size) for rid, allowed in outcome.constrained.items()})
        end = time.perf_counter()
        stats["step_seconds"] = self._counters.add_step_seconds(end - start)
        # The host's share: without async output processing all but the forward pass; with it, all but the wait for it
        # (the forward pass ran in the model thread, beside the host's work).
        schedule_s = ((end - start) - wait_s if self.config.async_output_processing
                      else (end - start) - model_s - draft_s)
        event = dataclasses.replace(event, time_s=end - self._start_time, duration_s=end - start,
                                    schedule_s=schedule_s, **self._host_and_forward(times, end - start, wait_s,
                                                                                    draft_s))
        for callback in list(self._subscribers):
            try:
                callback(event)
            except Exception:                         # an observer must never take the engine down
                logger.exception("a StepEvent subscriber raised; it stays subscribed")
        return event

    def _host_and_forward(self, times: StepTimes, duration_s: float, wait_s: float,
                          draft_s: float) -> dict[str, Optional[float]]:
        """StepEvent's host_s, forward_s and device_s (rounded to the microsecond: every watcher gets them).

        Without async output processing the step is host work, then the forward pass, then host work again:
        host_s + forward_s (+ a draft model's draft_s) = duration_s. With it, the forward pass ran in the model
        thread beside the host's work, so the two may add up to more than the step: the host's work is this
        ``step()``'s time but its wait for the model thread, plus what the model thread did outside the forward
        (the batch's tensors, the logits stage, sampling)."""
        if self.config.async_output_processing:
            host_s = duration_s - wait_s + times.prepare_s + times.model_s - times.forward_s
        else:
            host_s = duration_s - times.forward_s - draft_s
        device_s = None if times.device_s is None else round(times.device_s, 6)
        return {"host_s": round(max(host_s, 0.0), 6), "forward_s": round(times.forward_s, 6), "device_s": device_s}

    # ------------------------------------------------------------------ results out
    def generate(self, prompts: Union[Prompt, Iterable[Prompt]], params: Union[SamplingParams,
                 Sequence[SamplingParams], None] = None, *, use_tqdm: Optional[bool] = None) -> list[RequestOutput]:
        """Run prompts to completion, batched continuously; outputs come back in the order of the prompts.

        It steps the engine itself: outputs of requests someone else added with ``add_request`` are not
        delivered to them meanwhile (drive ``step`` yourself to serve both)."""
        prompts = as_prompt_list(prompts)
        param_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise InvalidRequestError(f"got {len(param_list)} SamplingParams for {len(prompts)} prompts.")
        checked = [self.inputs.process(p, sp) for p, sp in zip(prompts, param_list)]   # all or none are queued
        for prompt in checked:
            self.logits.compile(prompt.params)
        ids = [self._queue(prompt, None) for prompt in checked]
        wanted = set(ids)
        results: dict[str, RequestOutput] = {}
        show = sys.stderr.isatty() and len(prompts) >= 4 if use_tqdm is None else use_tqdm
        from tqdm import tqdm
        with tqdm(total=len(prompts), desc="Generating", unit="req", disable=not show) as bar:
            try:
                while len(results) < len(ids):
                    for delta in self.step().outputs:
                        if delta.output is not None and delta.request_id in wanted:
                            results[delta.request_id] = delta.output
                            bar.update(1)
            except BaseException:
                for rid in wanted - results.keys():      # leave the engine clean for the next caller
                    self.abort(rid)
                raise
        return [results[rid] for rid in ids]

    def chat(self, messages: Union[list[dict], list[list[dict]]], params: Optional[SamplingParams] = None,
             **kwargs: Any) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate([self.inputs.chat_prompt(c) for c in conversations], params, **kwargs)

    def reset_prefix_cache(self) -> int:
        """Forget all cached prefixes; returns how many blocks lost their hash."""
        return self.kv.reset_prefix_cache()

    @property
    def counters(self) -> dict[str, float]:
        """Running totals only: steps, tokens, preemptions, seconds ... (they only grow)."""
        return self._counters.totals

    def stats(self) -> dict[str, float]:
        """Gauges (blocks, queues, prefix-cache hit rate) and running totals, as every StepEvent carries."""
        return {**self._counters.snapshot(self.kv, self.cpu_pool, self.scheduler),
                **getattr(self.runner, "counters", {"communication_seconds": 0.0})}

    def close(self) -> None:
        """Stop the worker processes of a parallel engine, and the model thread of async output processing (after the
        forward pass in flight)."""
        self._wait_for_model()
        self._model_thread.close()
        self.runner.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
