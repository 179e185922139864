"""The logits stage of a step: between the forward pass and sampling (or speculative verification).

For every request whose parameters ask for it, the stage keeps its processors (built once, when the request
is queued) and applies them to that request's rows of logits in place, so the sampler and the rejection
sampler both see the processed distribution. A step in which no scheduled request has a processor or asks
for log-probabilities does nothing here at all: the default path costs one dictionary check per request.

Before processing, it takes the raw log-probabilities of the rows whose requests asked for them and returns
them with the step's structured-output constraints (``StageResult``): nothing of a step stays behind here.

One request's failure is that request's alone: a processor that raises, or constraints that leave no token
allowed, mark that request failed (``Request.error``: the client gets the message) and the step goes on for
the others; the engine aborts it when the step's tokens are counted. A request with structured outputs waits
here (``WAITING_FOR_GRAMMAR``) until its grammar has compiled in the background (``structured``); the engine
asks ``grammars_ready`` each step and queues it then.
"""
from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Any, Optional, Sequence

import torch

from ..request import Request, RequestStatus, SamplingParams, check_token_ids, fail_request
from .logprobs import StageResult, log_softmax_rows
from .processors import BadWordTable, LogitsProcessor, build_processors
from .structured import GRAMMAR_TIMEOUT_S, GrammarJob, GrammarMask, StructuredOutputCompiler


class LogitsStage:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 grammar_timeout_s: float = GRAMMAR_TIMEOUT_S) -> None:
        """``grammar_timeout_s``: the engine option ``grammar_timeout``, how long a grammar may compile."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.compiler = StructuredOutputCompiler(tokenizer, vocab_size, grammar_timeout_s)
        self._processors: dict[str, list[LogitsProcessor]] = {}     # request id -> its processors
        self._users: set[str] = set()           # requests with processors or asking for log-probabilities
        self._waiting: dict[str, tuple[Request, GrammarJob, float]] = {}   # for their grammar: (req, job, since)
        self._bad_words: tuple[Any, Optional[BadWordTable]] = (None, None)   # the last params' table (n samples)

    # ------------------------------------------------------------------ requests in and out
    def compile(self, params: SamplingParams) -> Optional[GrammarJob]:
        """Check every token id the processors will index with against the vocabulary, parse the grammar and
        start compiling it in the background (None if there is none); raises InvalidRequestError before the
        request is queued."""
        for name in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
            check_token_ids(name, list(getattr(params, name) or ()), self.vocab_size)
        return None if params.structured_outputs is None else self.compiler.compile(params.structured_outputs)

    def add(self, req: Request, grammar_job: Optional[GrammarJob] = None) -> bool:
        """Build the request's processors; False while its grammar compiles (the request waits here, in
        ``WAITING_FOR_GRAMMAR``, until ``grammars_ready`` hands it back)."""
        if grammar_job is not None:
            compiled, error = self.compiler.outcome(grammar_job, since=time.monotonic())
            if compiled is None and error is None:
                req.status = RequestStatus.WAITING_FOR_GRAMMAR
                self._waiting[req.request_id] = (req, grammar_job, time.monotonic())
                return False
            if error is not None:
                fail_request(req, error)
                return True
            return self._build(req, compiled)
        return self._build(req, None)

    def _build(self, req: Request, compiled_grammar: Any) -> bool:
        grammar = None if compiled_grammar is None else GrammarMask(compiled_grammar, self.vocab_size)
        table = None
        if req.params.bad_words:                     # built once for the n samples of one request
            if self._bad_words[0] is not req.params:
                self._bad_words = (req.params, BadWordTable.build(req.params.bad_words, self.tokenizer,
                                                                  self.vocab_size))
            table = self._bad_words[1]
        processors = build_processors(req.params, self.tokenizer, self.vocab_size, self.eos_token_ids, grammar,
                                      bad_words=table)
        if processors:
            self._processors[req.request_id] = processors
        if processors or req.params.logprobs is not None:
            self._users.add(req.request_id)
        return True

    def has_waiting(self) -> bool:
        return bool(self._waiting)

    def grammars_ready(self, wait_s: float = 0.0) -> list[Request]:
        """The waiting requests whose grammar is compiled (ready to queue) or failed (``req.error`` says why,
        to be finished as aborted). ``wait_s``: block up to this long for one (only when nothing else runs)."""
        if not self._waiting:
            return []
        if wait_s > 0:
            wait({job.future for _req, job, _since in self._waiting.values()}, timeout=wait_s,
                 return_when=FIRST_COMPLETED)
        now, done = time.monotonic(), []
        for rid, (req, job, since) in list(self._waiting.items()):
            if req.is_finished:                # aborted while its grammar compiled: nothing to queue
                del self._waiting[rid]
                continue
            compiled, error = self.compiler.outcome(job, since, now)
            if compiled is None and error is None:
                continue
            del self._waiting[rid]
            req.status = RequestStatus.WAITING
            if error is not None:
                fail_request(req, error)
            else:
                self._build(req, compiled)
            done.append(req)
        return done

    def forget(self, request_id: str) -> None:
        """Drop an ended request's processors (the executor calls it on the scheduler output's finished ids)."""
        self._processors.pop(request_id, None)
        self._users.discard(request_id)

    def needed_by(self, requests: Sequence[Request]) -> bool:
        """Whether any of this step's requests has work here; with none in the engine, one set check."""
        return bool(self._users) and any(r.request_id in self._users for r in requests)

    # ------------------------------------------------------------------ each step
    @torch.inference_mode()              # the forward pass's logits are inference tensors: edit them in that mode
    def process(self, requests: Sequence[Request], rows: Sequence[torch.Tensor],
                drafts: dict[str, Sequence[int]]) -> StageResult:
        """Take the raw log-probabilities asked for, then edit each request's rows in place. ``rows[i]`` is
        request i's [1 + drafts, vocab] block of logits; its row j follows the output plus drafts[:j]. A request
        whose processing raises, or whose first row has no token left allowed, is marked failed (``req.error``)."""
        result = StageResult()
        for req, block in zip(requests, rows):
            if req.params.logprobs is not None:
                result.raw_logprobs[req.request_id] = (log_softmax_rows(block), req.params.logprobs)
            processors = self._processors.get(req.request_id)
            if not processors:
                continue
            try:
                self._apply(req, processors, block, list(drafts.get(req.request_id, ())), result.constrained)
            except Exception as exc:             # one request's processor: that request fails, not the step
                fail_request(req, f"processing this request's logits failed ({type(exc).__name__}: {exc}).")
                continue
            if not bool(torch.isfinite(block[0]).any()):
                fail_request(req, f"no token is allowed after {len(req.output_token_ids)} generated token(s): "
                                  f"the request's constraints ({', '.join(type(p).__name__ for p in processors)}) "
                                  f"exclude every token; loosen allowed_token_ids, bad_words, logit_bias or the "
                                  f"structured output.")
        return result

    def _apply(self, req: Request, processors: list[LogitsProcessor], block: torch.Tensor,
               draft: list[int], constrained: dict[str, int]) -> None:
        grammar = processors[-1] if isinstance(processors[-1], GrammarMask) else None
        if grammar is not None:
            grammar.num_allowed = None
        for j in range(block.shape[0]):
            history = req.output_token_ids + draft[:j] if j else req.output_token_ids   # row 0: no copy
            for processor in processors:
                processor.apply(block[j], req.prompt_token_ids, history)
            if grammar is not None and j == 0 and grammar.num_allowed is not None:
                constrained[req.request_id] = grammar.num_allowed
