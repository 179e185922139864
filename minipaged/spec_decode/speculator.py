"""The engine's side of speculative decoding: draft after a step, verify in the next.

``Engine.step`` calls ``propose`` once the step's tokens are in: every request that got a token and decodes
next gets up to k guesses (``Request.spec_token_ids``), which the scheduler adds to its next decode. After
that step's forward pass, ``verify`` runs the rejection sampler on each request's rows of logits. A
drafting model's probabilities (q) wait here between the two, keyed by request.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Sequence

import torch

from ..kernels import Backend
from ..request import Request, RequestStatus
from ..sampling import Sampler
from .auto_k import AutoK
from .config import INT8_SELF_DRAFT, SpeculativeConfig
from .draft_model import DraftModelProposer
from .ngram import NgramProposer
from .proposer import Draft, Proposer
from .rejection_sampler import Verified, greedy_verdict, verify

logger = logging.getLogger("minipaged.spec_decode")


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int, sampler: Sampler) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.sampler = sampler                         # the requests' own seeded generators
        self._draft_probs: dict[str, torch.Tensor] = {}
        self.verify_drafts = verify                    # the rejection sampler (lab 4 runs a student's in its place)
        # the automatic k (auto_k.py; None: always k); a free proposer's idle requests are watched, not drifted
        self.auto = AutoK(drift=config.uses_draft_model) if config.auto_k else None
        self._watched: dict[str, tuple[int, int]] = {}   # request -> (position, the guess made for it, unverified)

    def propose(self, requests: Sequence[Request]) -> float:
        """Guess the next tokens of every request here that decodes next; returns the seconds it took.

        A request drafts at most k tokens, none that would pass max_model_len, and none beyond its last
        possible token (every verification adds one token of the target's own)."""
        begin = time.perf_counter()
        k = self.config.num_speculative_tokens
        ready = {r.request_id: r for r in requests if r.status is RequestStatus.RUNNING and not r.is_prefill}
        limits = {rid: max(0, min(k, self.max_model_len - r.num_tokens,
                                  r.params.max_tokens - len(r.output_token_ids) - 1)) for rid, r in ready.items()}
        if self.auto is None:
            self._take(ready, self.proposer.propose(list(ready.values()), limits))
        elif self.config.uses_draft_model:        # drafting costs passes: choose k first, then draft that many
            limits = self.auto.choose(limits)
            self._show_choice(ready, limits)
            self._take(ready, self.proposer.propose(list(ready.values()), limits))
            self.auto.observe_drafting(getattr(self.proposer, "pass_seconds", []))
        else:
            self._look_up_then_choose(ready, limits)
        return time.perf_counter() - begin

    def _look_up_then_choose(self, ready: dict[str, Request], limits: dict[str, int]) -> None:
        """The automatic k with a free proposer (the n-gram lookup): look up every request's guess first, then
        choose among the requests that have one (a request with no match is a plain row, not a draft that might
        be), each up to its guess's length. An idle request's guess is watched: checked against the token that
        comes, what its verification would have said. Where no draft could pay, nothing is looked up."""
        self._check_watched(ready)
        if not self.auto.worth_trying(len(ready)):
            self._show_choice(ready, {rid: 0 for rid in ready})
            return
        guesses = self.proposer.propose(list(ready.values()), limits)
        chosen = self.auto.choose({rid: len(guesses[rid].token_ids) if rid in guesses else 0 for rid in ready})
        self._show_choice(ready, chosen)
        for rid, guess in guesses.items():
            if chosen[rid] == 0:
                self._watched[rid] = (ready[rid].num_tokens, guess.token_ids[0])
        self._take(ready, {rid: guess.trimmed(chosen[rid]) for rid, guess in guesses.items() if chosen[rid]})

    def _show_choice(self, ready: dict[str, Request], chosen: dict[str, int]) -> None:
        """Each request's k and acceptance estimate, for the step's event (the TUI and the page show them)."""
        for rid, req in ready.items():
            req.spec_k, req.spec_acceptance = chosen[rid], self.auto.acceptance.get(rid)

    def _take(self, ready: dict[str, Request], drafts: dict[str, Draft]) -> None:
        """The drafts go on their requests, for the scheduler to add to their next decode."""
        for rid, draft in drafts.items():
            ready[rid].spec_token_ids = draft.token_ids
            if draft.probs is not None:
                self._draft_probs[rid] = draft.probs

    def _check_watched(self, ready: dict[str, Request]) -> None:
        """The guesses made for idle requests, against the tokens that came: what their verification would
        have said."""
        for rid, (position, guess) in list(self._watched.items()):
            req = ready.get(rid)
            if req is not None and req.num_tokens > position:
                del self._watched[rid]
                self.auto.observe_verification(rid, int(req.all_token_ids[position] == guess), 1)

    def observe_step(self, chunks: Sequence[Any], seconds: float, draft_s: float) -> None:
        """A step took ``seconds``, ``draft_s`` of them proposing the next step's drafts: the automatic k learns
        what rows cost from the steps of decodes (with or without drafts) alone, all of such a step (scheduling,
        the forward pass, verification, the outputs and the event: a verification's host work costs as surely as
        its rows do). A draft model's passes are timed apart (``AutoK.draft_pass``); the n-gram
        lookups stay in the step's cost, which grows with the requests that look up."""
        if self.auto is not None and chunks and all(c.kind == "decode" for c in chunks):
            drafting = draft_s if self.config.uses_draft_model else 0.0
            self.auto.cost.observe(sum(c.num_new_tokens for c in chunks), seconds - drafting)

    def verify(self, req: Request, rows: torch.Tensor, draft_token_ids: Sequence[int],
               argmax: Optional[list[int]] = None) -> Optional[Verified]:
        """The rejection sampler on one request's rows (last token + each draft); None if it failed. ``argmax``:
        the rows' argmax, worked out for the whole step at once (a greedy request then needs nothing more)."""
        probs = self._draft_probs.pop(req.request_id, None)
        draft = Draft(list(draft_token_ids), None if probs is None else probs[:len(draft_token_ids)])
        try:
            if argmax is not None and req.params.greedy and self.verify_drafts is verify:
                verdict = greedy_verdict(argmax, draft.token_ids)
            else:
                verdict = self.verify_drafts(rows, draft, req.params, self.sampler.generator_for(req))
            if self.auto is not None:
                self.auto.observe_verification(req.request_id, verdict.num_accepted, verdict.num_draft_tokens)
            return verdict
        except (RuntimeError, ValueError) as exc:
            logger.error("verifying drafts failed for request %s (%s); it is aborted.", req.request_id, exc)
            return None

    def forget(self, request_id: str) -> None:
        """The request finished or lost its KV (preempted): its drafts and the draft model's state go."""
        self._draft_probs.pop(request_id, None)
        self.proposer.forget(request_id)
        if self.auto is not None:
            self.auto.forget(request_id)
            self._watched.pop(request_id, None)


def build_speculator(config: SpeculativeConfig, draft_model: Any, *, num_blocks: int, block_size: int,
                     backend: Backend, block_table_of: Callable[[str], list[int]], max_model_len: int,
                     sampler: Sampler, target_kv_cache: Optional[torch.Tensor] = None) -> Speculator:
    """The proposer the configuration names, wrapped for the engine."""
    if config.method == "ngram":
        proposer: Proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    else:
        shared = target_kv_cache if config.method == INT8_SELF_DRAFT else None
        proposer = DraftModelProposer(draft_model, num_blocks, block_size, backend, block_table_of, sampler, shared)
    return Speculator(config, proposer, max_model_len, sampler)
