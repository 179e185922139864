"""The logits stage of a step: between the forward pass and sampling (or speculative verification).

For every request whose parameters ask for it, the stage keeps its processors (built once, when the request
is queued) and applies them to that request's rows of logits in place, so the sampler and the rejection
sampler both see the processed distribution. A step in which no scheduled request has a processor or asks
for log-probabilities does nothing here at all: the default path costs one dictionary check per request.

Before processing, it keeps the raw log-probabilities of the rows whose requests asked for them; once the
step's tokens are known, ``take_logprobs`` pairs each new token with its row.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..request import InvalidRequestError, Request, SamplingParams
from .logprobs import TokenLogprobs, log_softmax_rows, token_logprobs
from .processors import LogitsProcessor, build_processors
from .structured import GrammarMask, StructuredOutputCompiler


class LogitsStage:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.compiler = StructuredOutputCompiler(tokenizer, vocab_size)
        self._processors: dict[str, list[LogitsProcessor]] = {}     # request id -> its processors
        self._users: set[str] = set()           # requests with processors or asking for log-probabilities
        self._raw_logprobs: dict[str, tuple[torch.Tensor, int]] = {}   # this step's rows and top N, until taken
        self._constrained: dict[str, int] = {}      # this step: request id -> tokens its grammar allowed (first row)

    # ------------------------------------------------------------------ requests in and out
    def compile(self, params: SamplingParams) -> Any:
        """Check what the processors need from the vocabulary and compile a grammar (None if there is none);
        raises InvalidRequestError before the request is queued."""
        ids = list(params.logit_bias or ()) + list(params.allowed_token_ids or ())
        outside = [t for t in ids if t >= self.vocab_size]
        if outside:
            raise InvalidRequestError(f"token id(s) {outside[:5]} in logit_bias / allowed_token_ids are outside the "
                                      f"vocabulary (0..{self.vocab_size - 1}).")
        return None if params.structured_outputs is None else self.compiler.compile(params.structured_outputs)

    def add(self, req: Request, compiled_grammar: Any = None) -> None:
        grammar = None if compiled_grammar is None else GrammarMask(compiled_grammar, self.vocab_size)
        processors = build_processors(req.params, self.tokenizer, self.vocab_size, self.eos_token_ids, grammar)
        if processors:
            self._processors[req.request_id] = processors
        if processors or req.params.logprobs is not None:
            self._users.add(req.request_id)

    def forget(self, request_id: str) -> None:
        self._processors.pop(request_id, None)
        self._raw_logprobs.pop(request_id, None)
        self._users.discard(request_id)

    def needed_by(self, requests: Sequence[Request]) -> bool:
        """Whether any of this step's requests has work here; with none in the engine, one set check."""
        return bool(self._users) and any(r.request_id in self._users for r in requests)

    # ------------------------------------------------------------------ each step
    @torch.inference_mode()              # the forward pass's logits are inference tensors: edit them in that mode
    def process(self, requests: Sequence[Request], rows: Sequence[torch.Tensor],
                drafts: dict[str, Sequence[int]]) -> None:
        """Keep the raw log-probabilities asked for, then edit each request's rows in place. ``rows[i]`` is
        request i's [1 + drafts, vocab] block of logits; its row j follows the output plus drafts[:j]."""
        for req, block in zip(requests, rows):
            if req.params.logprobs is not None:
                self._raw_logprobs[req.request_id] = (log_softmax_rows(block), req.params.logprobs)
            processors = self._processors.get(req.request_id)
            if not processors:
                continue
            draft = list(drafts.get(req.request_id, ()))
            grammar = processors[-1] if isinstance(processors[-1], GrammarMask) else None
            if grammar is not None:
                grammar.num_allowed = None
            for j in range(block.shape[0]):
                history = req.output_token_ids + draft[:j] if j else req.output_token_ids   # row 0: no copy
                for processor in processors:
                    processor.apply(block[j], req.prompt_token_ids, history)
                if grammar is not None and j == 0 and grammar.num_allowed is not None:
                    self._constrained[req.request_id] = grammar.num_allowed

    def drain_constrained(self) -> dict[str, int]:
        """Requests whose next token a structured-output mask constrained since the last call, and how many
        tokens it allowed (for the StepEvent)."""
        constrained, self._constrained = self._constrained, {}
        return constrained

    def take_logprobs(self, new_token_ids: dict[str, list[int]]) -> dict[str, list[TokenLogprobs]]:
        """The raw log-probabilities of each request's new tokens (row j scored the j-th new token)."""
        if not self._raw_logprobs:
            return {}
        rows, self._raw_logprobs = self._raw_logprobs, {}
        return {rid: token_logprobs(lp, new_token_ids[rid], num_top)
                for rid, (lp, num_top) in rows.items() if new_token_ids.get(rid)}


def prompt_logprobs(logits: torch.Tensor, prompt_token_ids: Sequence[int], first: int,
                    num_top: int) -> list[TokenLogprobs]:
    """Rows scoring prompt tokens ``first, first + 1, ...`` (row i is the position before each)."""
    return token_logprobs(log_softmax_rows(logits), prompt_token_ids[first:first + logits.shape[0]], num_top)
