"""The engine: requests in, tokens out, one ``step()`` at a time. A front end around an engine core, as in
vLLM v1 (the front end is what ``minipaged serve`` keeps in its API server; the core is what it runs apart).

Follow a request from top to bottom:
  1. ``add_request``: the ``InputProcessor`` validates the prompt, tokenises it, checks that it fits, and makes
     a ``Request`` (n of them for n samples); the output processor starts its text; the core queues it
     (a request with structured outputs first waits while its grammar compiles in the background).
  2. ``step`` runs one step of the ``EngineCore`` (engine_core.py): the scheduler picks who runs and how many
     tokens each computes, the executor runs the model once over all of them and samples, and
     ``update_from_output`` appends the tokens and ends requests that a token ends (EOS, stop ids, lengths).
  3. The ``OutputProcessor`` turns the new tokens into text and deltas; a stop string it finds ends its
     request through the core (``finish_requests``), as vLLM's front end sends an abort.
  4. The ``StepRecorder`` (an observer, outside the core) builds the step's ``StepEvent`` from the same
     outputs and the block pool's change log, and hands it to subscribers (the TUI, traces, metrics, the web).
  5. ``step`` returns a ``StepResult``: ``outputs``, the deltas clients read, and ``event``.

The engine's surface: ``add_request``, ``abort``, ``step``, ``has_unfinished_requests``, ``info``, ``stats``,
``subscribe`` (observers), and ``generate`` / ``chat`` on top.
Its parts (``engine_builder.EngineParts``) are attributes, for those who study or test them.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence, Union

from .engine_builder import build_engine_parts
from .input_processor import as_prompt_list
from .outputs import StepResult
from .request import InvalidRequestError, RequestStatus

if TYPE_CHECKING:
    from .events import StepEvent
    from .input_processor import Prompt, ProcessedPrompt
    from .outputs import RequestOutput
    from .request import Request, SamplingParams


class Engine:
    """A paged-KV, continuously batched inference engine for Llama-architecture models."""

    def __init__(self, model: str = "smollm2", *, load_progress: Optional[Callable[[str], None]] = None,
                 **options: Any) -> None:
        parts = build_engine_parts(model, options, load_progress)
        for part in dataclasses.fields(parts):   # config, info, tokenizer, inputs, core, outputs, recorder; and
            setattr(self, part.name, getattr(parts, part.name))   # the core's own parts (scheduler, kv, runner ...)

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
        self.recorder.arrive(requests, self.inputs.prompt_text(prompt))
        for req in requests:
            self.core.add_request(req, grammar)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request (or all n samples of it) now and free its blocks; its caller gets no more outputs
        for it (the next event still shows the abort to observers). False if it is not running."""
        requests = self.core.finish_requests(self.outputs.unfinished(request_id), RequestStatus.FINISHED_ABORTED)
        self._finish(requests, time.perf_counter(), deliver=False)
        return bool(requests)

    def has_unfinished_requests(self) -> bool:
        """True while a request waits (for its grammar, too), runs or is swapped out, or (async output
        processing) a forward pass is in flight."""
        return self.core.has_unfinished_requests()

    def subscribe(self, callback: Callable[[StepEvent], None]) -> Callable[[], None]:
        """Call ``callback(event)`` after every step; returns a function that unsubscribes it."""
        self.recorder.subscribers.append(callback)

        def unsubscribe() -> None:                # calling it twice is harmless
            if callback in self.recorder.subscribers:
                self.recorder.subscribers.remove(callback)
        return unsubscribe

    # ------------------------------------------------------------------ one step
    def step(self) -> StepResult:
        """One engine step: the core's (schedule, run the model once, sample, append), then the front end's
        (text, stop strings, deltas) and the observers' event (also handed to every ``subscribe``r).

        With async output processing it returns the previous step's outputs while this one computes."""
        start = time.perf_counter()
        core_out = self.core.step()
        now = time.perf_counter()
        out = core_out.runner_output
        if out is not None:
            for req, first, entries in out.prompt_logprobs:
                self.outputs.record_prompt_logprobs(req, first, entries)
        stopped = self.outputs.process_tokens(core_out.new_token_ids, now, out.logprobs if out else None)
        ended = list(core_out.finished)
        for req, stop in stopped:                          # a stop string, found in the text
            ended += self.core.finish_requests([req], RequestStatus.FINISHED_STOPPED, stop)
        ended += self.core.finish_requests(self.outputs.take_failed(), RequestStatus.FINISHED_ABORTED)
        self._finish(ended, time.perf_counter())
        drained = self.outputs.drain()                     # the step's deltas, and the same as observers see it
        self.core.drop_finished_state()                    # idle now: nothing waits for a next step to drop it
        event = self.recorder.record(core_out, drained, start)
        if self.speculator is not None and core_out.scheduler_output is not None:   # the automatic k learns
            self.speculator.observe_step(core_out.scheduler_output.chunks, event.duration_s, event.draft_s)
        return StepResult(drained.deltas, event)

    def _finish(self, requests: Sequence[Request], now: float, deliver: bool = True) -> None:
        for req in requests:
            self.recorder.finish(self.outputs.finish(req, now, deliver))

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
        if any(sp is not None and sp.output_kind != "cumulative" for sp in param_list):
            raise InvalidRequestError("generate returns whole outputs: leave output_kind 'cumulative' ('delta' is for "
                                      "callers of step() that read the step deltas, as serve's streams do).",
                                      "output_kind")
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
        """Running totals only: steps, tokens, preemptions, finished requests, seconds ... (they only grow)."""
        return {**self.core.counters.totals, "requests_finished": self.core.scheduler.num_finished}

    def stats(self) -> dict[str, float]:
        """Gauges (blocks, queues, prefix-cache hit rate) and running totals, as every StepEvent carries."""
        return self.core.stats()

    def close(self) -> None:
        """Stop the worker processes of a parallel engine, and the model thread of async output processing
        (after the forward pass in flight)."""
        self.core.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
