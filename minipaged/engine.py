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
  7. The ``OutputProcessor`` turns tokens into text and builds ``RequestOutput``s; a stop string it finds
     ends its request through the scheduler (``finish_on_stop_string``). The engine writes no request field.
  8. With speculative decoding on, a proposer guesses each decoding request's next k tokens; the next
     step schedules them with the request's last token and the rejection sampler keeps those the target
     agrees with (``minipaged.spec_decode``).
  9. A ``StepEvent`` records all of it for the TUI, traces and metrics.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
import time
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from .engine_builder import build_engine_parts
from .execute_step import execute_and_sample
from .events import RequestArrival, RequestFinish, StepEvent
from .input_processor import Prompt, ProcessedPrompt, as_prompt_list
from .outputs import RequestOutput
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
        # config, model, backend, kv, scheduler, runner, sampler, outputs, ... (engine_builder.EngineParts)
        vars(self).update(vars(build_engine_parts(model, options, load_progress)))
        self._pending_arrivals: list[RequestArrival] = []   # what happened between steps goes in the next event
        self._pending_finishes: list[RequestFinish] = []
        self._subscribers: list[Callable[[StepEvent], None]] = []
        self._step_index = 0
        self._start_time = time.perf_counter()
        self._counters = EngineCounters()
        self.step_logprobs: dict[str, list] = {}          # the last step's new tokens' log-probabilities (streams)

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
        self.outputs.add_requests(request_id, requests)
        text = self.inputs.prompt_text(prompt)
        for req in requests:
            if self.logits.add(req, grammar):             # False: it waits for its grammar to compile
                self._schedule_or_fail(req)
            self._pending_arrivals.append(RequestArrival(req.request_id, req.num_prompt_tokens,
                                                         req.params.max_tokens, text,
                                                         req.arrival_time - self._start_time))
        return request_id

    def _schedule_or_fail(self, req: Request) -> None:
        """Queue a request whose processors are ready, or finish it as aborted if preparing them failed."""
        if req.error is None:
            self.scheduler.add(req)
        else:
            req.status = RequestStatus.FINISHED_ABORTED
            self._record_finish(req, time.perf_counter())

    def abort(self, request_id: str) -> bool:
        """Stop a request (or all n samples of it) now and free its blocks. False if it is not running."""
        requests = self.outputs.unfinished(request_id)
        self.scheduler.finish_requests(requests, RequestStatus.FINISHED_ABORTED)   # O(samples), not O(samples^2)
        for req in requests:
            self._record_finish(req, time.perf_counter())
        return bool(requests)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.logits.has_waiting()

    def subscribe(self, callback: Callable[[StepEvent], None]) -> Callable[[], None]:
        """Call ``callback(event)`` after every step; returns a function that unsubscribes it."""
        self._subscribers.append(callback)

        def unsubscribe() -> None:                # calling it twice is harmless
            if callback in self._subscribers:
                self._subscribers.remove(callback)
        return unsubscribe

    # ------------------------------------------------------------------ one step
    def step(self) -> StepEvent:
        start = time.perf_counter()
        # Requests whose grammar compiled (or failed) meanwhile; with nothing else to run, wait a moment for one.
        for req in self.logits.grammars_ready(wait_s=0.0 if self.scheduler.has_unfinished() else GRAMMAR_POLL_S):
            self._schedule_or_fail(req)
        plan = self.scheduler.schedule()                   # who runs, how many tokens, which blocks
        for req in plan.failed:                            # a policy raised deciding about it: aborted
            self._record_finish(req, time.perf_counter())
        for p in plan.preempted:                           # its KV is gone (or swapped): so is the draft's
            self._drop_drafts(p.request.request_id)
        self.runner.swap_blocks(self.cpu_kv_cache, plan.swap_out, plan.swap_in)   # before the model reads the cache
        sampled, verified, model_s = execute_and_sample(      # request id -> its new tokens (None: sampling failed)
            plan, self.runner, self.logits, self.sampler, self.outputs, self.speculator)
        update = self.scheduler.update_from_output(plan, sampled)     # appended; finished on EOS, stop ids, length
        logprobs = self.logits.take_logprobs(update.new_token_ids)
        for req, stop, surplus in self.outputs.process_tokens(update.new_token_ids, time.perf_counter(), logprobs):
            self.scheduler.finish_on_stop_string(req, stop, surplus, update)     # a stop string, found in the text
        for req in update.finished:
            self._record_finish(req, time.perf_counter())
        self.step_logprobs = self.outputs.drain_logprobs()
        draft_s = 0.0
        if self.speculator is not None:                    # guesses for the next step
            draft_s = self.speculator.propose([c.request for c in plan.chunks
                                               if c.request.request_id in update.new_token_ids])
        return self._emit(plan, update.new_token_ids, verified, start, model_s, draft_s)

    def _drop_drafts(self, request_id: str) -> None:
        if self.speculator is not None:
            self.speculator.forget(request_id)

    def _record_finish(self, req: Request, now: float) -> None:
        self.sampler.forget(req.request_id)
        self.logits.forget(req.request_id)
        self._drop_drafts(req.request_id)
        self._counters.count_finish()
        self._pending_finishes.append(self.outputs.finish(req, now))

    def _emit(self, plan: SchedulerOutput, new_token_ids: dict[str, list[int]], verified: dict[str, Verified],
              start: float, model_s: float, draft_s: float) -> StepEvent:
        """Count the step, build its StepEvent (its time includes building it: taken last, written in after)
        and hand it to every subscriber."""
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
            new_token_ids=new_token_ids, new_text=self.outputs.drain_text(), kv=self.kv.drain_changes(),
            num_free_blocks=stats["blocks_free"], num_cached_free_blocks=stats["blocks_cached_free"],
            num_total_blocks=stats["blocks_total"], num_free_cpu_blocks=stats["cpu_blocks_free"],
            num_total_cpu_blocks=stats["cpu_blocks_total"],
            waiting=tuple(r.request_id for r in s.waiting), running=tuple(r.request_id for r in s.running),
            swapped=tuple(r.request_id for r in s.swapped), counters=stats,
            new_logprobs={rid: [position[token].logprob for position, token in zip(positions, new_token_ids[rid])]
                          for rid, positions in self.step_logprobs.items() if rid in new_token_ids},
            constrained={rid: (allowed, self.logits.vocab_size)
                         for rid, allowed in self.logits.drain_constrained().items()})
        end = time.perf_counter()
        stats["step_seconds"] = self._counters.add_step_seconds(end - start)
        event = dataclasses.replace(event, time_s=end - self._start_time, duration_s=end - start,
                                    schedule_s=(end - start) - model_s - draft_s)
        for callback in list(self._subscribers):
            try:
                callback(event)
            except Exception:                         # an observer must never take the engine down
                logger.exception("a StepEvent subscriber raised; it stays subscribed")
        return event

    # ------------------------------------------------------------------ results out
    def pop_finished(self) -> list[RequestOutput]:
        """Outputs of the requests finished since the last call (for callers driving ``step`` themselves)."""
        return self.outputs.pop_finished()

    def generate(self, prompts: Union[Prompt, Iterable[Prompt]], params: Union[SamplingParams,
                 Sequence[SamplingParams], None] = None, *, use_tqdm: Optional[bool] = None) -> list[RequestOutput]:
        """Run prompts to completion, batched continuously; outputs come back in the order of the prompts."""
        prompts = as_prompt_list(prompts)
        param_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise InvalidRequestError(f"got {len(param_list)} SamplingParams for {len(prompts)} prompts.")
        checked = [self.inputs.process(p, sp) for p, sp in zip(prompts, param_list)]   # all or none are queued
        for prompt in checked:
            self.logits.compile(prompt.params)
        ids = [self._queue(prompt, None) for prompt in checked]
        results: dict[str, RequestOutput] = {}
        show = sys.stderr.isatty() and len(prompts) >= 4 if use_tqdm is None else use_tqdm
        from tqdm import tqdm
        with tqdm(total=len(prompts), desc="Generating", unit="req", disable=not show) as bar:
            try:
                while len(results) < len(ids):
                    self.step()
                    for rid in ids:
                        for out in ([] if rid in results else self.outputs.pop_finished(rid)):
                            results[rid] = out
                            bar.update(1)
            except BaseException:
                for rid in set(ids) - results.keys():   # leave the engine clean for the next caller
                    self.abort(rid)
                    self.outputs.pop_finished(rid)
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
        """Stop the worker processes of a parallel engine (a single-process engine has nothing to stop)."""
        self.runner.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
