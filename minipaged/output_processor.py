"""Tokens out: text, stop strings, stream deltas and the ``RequestOutput`` a caller gets back.

The scheduler decides everything a token alone decides (EOS, stop token ids, lengths). What needs *text*
happens here, after each step (as in vLLM v1's ``OutputProcessor``):
  * each request's text grows by an ``IncrementalDetokenizer`` (constant work per token);
  * stop strings are searched for in the new text only; a hit cuts the text before the stop string and
    asks the engine to finish the request (it also overrides a length finish in the same token);
  * streams get their text as deltas. Until a request finishes, the last ``len(longest stop) - 1``
    characters are held back: they may be the start of a stop string, which the final text leaves out;
  * ``n > 1`` samples of one prompt run as separate requests and are gathered into one ``RequestOutput``
    once the last of them finishes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .detokenizer import IncrementalDetokenizer
from .events import RequestFinish
from .outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput, TokenLogprobs
from .request import Request, RequestStatus


@dataclass
class RequestState:
    """What the output side keeps for one running request (one sample)."""

    request: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""                     # the output text, cut before a stop string once one is found
    num_streamed_chars: int = 0        # text[:this] has gone out in StepEvents' new_text
    token_times: list[float] = field(default_factory=list)
    finished_time: Optional[float] = None
    logprobs: list[PositionLogprobs] = field(default_factory=list)             # when the request asked
    prompt_logprobs: list[Optional[PositionLogprobs]] = field(default_factory=list)

    @property
    def first_token_time(self) -> Optional[float]:
        return self.token_times[0] if self.token_times else None


class OutputProcessor:
    """Owns every request the caller has not collected yet: running samples, and finished outputs."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, RequestState] = {}       # sub-request id -> its state, until its parent is done
        self._children: dict[str, list[str]] = {}        # user-visible id -> sub-request ids (n > 1)
        self._finished: dict[str, RequestOutput] = {}    # user-visible id -> output, until collected
        self._num_running: dict[str, int] = {}           # user-visible id -> its samples not finished yet
        self._new_text: dict[str, str] = {}              # stream deltas since the last step's event
        self._new_logprobs: dict[str, list[PositionLogprobs]] = {}   # the same, for log-probabilities

    # ------------------------------------------------------------------ bookkeeping
    def add_requests(self, parent_id: str, requests: list[Request]) -> None:
        self._children[parent_id] = [r.request_id for r in requests]
        self._num_running[parent_id] = len(requests)
        for req in requests:
            state = RequestState(req, IncrementalDetokenizer(self.tokenizer))
            if req.params.prompt_logprobs is not None:
                state.prompt_logprobs = [None] * req.num_prompt_tokens
            self._states[req.request_id] = state

    def id_in_use(self, request_id: str) -> bool:
        return request_id in self._states or request_id in self._children or request_id in self._finished

    def unfinished(self, request_id: str) -> list[Request]:
        """The samples of a user-visible id (or the one request with that id) that are still running."""
        ids = self._children.get(request_id, [request_id])
        return [self._states[rid].request for rid in ids
                if rid in self._states and not self._states[rid].request.is_finished]

    # ------------------------------------------------------------------ each step
    def process_tokens(self, new_token_ids: dict[str, list[int]], now: float,
                       logprobs: Optional[dict[str, list[TokenLogprobs]]] = None) -> list[tuple[Request, str, int]]:
        """Grow each request's text by its new tokens (and log-probabilities, for those that asked); returns
        the requests a stop string ends, with it and how many of the new tokens came after the one that
        completed it (speculative decoding appends several tokens a step; those after a stop must go, as if
        generated one at a time)."""
        stopped: list[tuple[Request, str, int]] = []
        logprobs = logprobs or {}
        for rid, tokens in new_token_ids.items():
            state = self._states[rid]
            req = state.request
            token_logprobs = logprobs.get(rid, ())
            for i, token in enumerate(tokens):
                state.token_times.append(now)
                if i < len(token_logprobs):
                    position = self.position_logprobs(token_logprobs[i])
                    state.logprobs.append(position)
                    self._new_logprobs.setdefault(rid, []).append(position)
                old_len = len(state.text)
                state.text += state.detokenizer.add_tokens([token])
                stop = None if req.status is RequestStatus.FINISHED_STOPPED else self._find_stop(state, old_len)
                if stop is not None:
                    stopped.append((req, stop, len(tokens) - 1 - i))
                    break
            else:
                if not req.is_finished:
                    self._stream(state, finished=False)
        return stopped

    def position_logprobs(self, entry: TokenLogprobs) -> PositionLogprobs:
        """vLLM's shape: token id -> Logprob, the top N first, then the chosen token if not among them."""
        def piece(token_id: int) -> str:
            return self.tokenizer.decode([token_id])
        position = {tid: Logprob(lp, rank, piece(tid)) for rank, (tid, lp) in enumerate(entry.top, start=1)}
        if entry.token_id not in position:
            position[entry.token_id] = Logprob(entry.logprob, entry.rank, piece(entry.token_id))
        return position

    def record_prompt_logprobs(self, req: Request, first: int, entries: list[TokenLogprobs]) -> None:
        """Prompt tokens ``first, first + 1, ...`` scored (a recompute after preemption writes the same again)."""
        state = self._states.get(req.request_id)
        if state is None:
            return
        for i, entry in enumerate(entries):
            state.prompt_logprobs[first + i] = self.position_logprobs(entry)

    def prompt_logprobs_of(self, request_id: str) -> Optional[list[Optional[PositionLogprobs]]]:
        """A running request's prompt log-probabilities (None if it did not ask, or is no longer running)."""
        state = self._states.get(request_id)
        if state is None or state.request.params.prompt_logprobs is None:
            return None
        return list(state.prompt_logprobs)

    def drain_logprobs(self) -> dict[str, list[PositionLogprobs]]:
        """The log-probabilities of the tokens since the last call, per request (streams send them)."""
        new, self._new_logprobs = self._new_logprobs, {}
        return new

    @staticmethod
    def _find_stop(state: RequestState, old_len: int) -> Optional[str]:
        """The earliest stop string in the text, searching only where the new text could complete one;
        cuts the text before it."""
        stops = state.request.params.stop
        if not stops:
            return None
        search_from = max(0, old_len - max(len(s) for s in stops) + 1)
        hits = [(i, s) for i, s in ((state.text.find(s, search_from), s) for s in stops) if i >= 0]
        if not hits:
            return None
        index, stop = min(hits)
        state.text = state.text[:index]
        return stop

    def _stream(self, state: RequestState, finished: bool) -> None:
        """Queue the text that can go out now (see the module docstring for what is held back)."""
        stops = state.request.params.stop
        hold = 0 if finished or not stops else max(len(s) for s in stops) - 1
        end = max(state.num_streamed_chars, len(state.text) - hold)
        delta = state.text[state.num_streamed_chars:end]
        state.num_streamed_chars = end
        if delta:
            rid = state.request.request_id
            self._new_text[rid] = self._new_text.get(rid, "") + delta

    def finish(self, req: Request, now: float) -> RequestFinish:
        """Record a finished (or aborted) request: flush its held-back text, and once all samples of its
        prompt are done, build the caller's ``RequestOutput``. Returns the event's record of it."""
        state = self._states[req.request_id]
        first_finish = state.finished_time is None
        state.finished_time = now
        self._stream(state, finished=True)
        times = state.token_times
        itls = [b - a for a, b in zip(times, times[1:])]
        record = RequestFinish(
            req.request_id, req.status.value, req.num_prompt_tokens, len(req.output_token_ids),
            max(req.num_cached_tokens, 0), None if not times else times[0] - req.arrival_time,
            now - req.arrival_time, sum(itls) / len(itls) if itls else None)
        parent = req.parent_id or req.request_id
        self._num_running[parent] -= first_finish       # a count, not a walk over the samples: aborting
        if self._num_running[parent] == 0:              # n samples stays O(n), not O(n^2)
            samples = [self._states[rid] for rid in self._children[parent]]
            self._finished[parent] = self._build_output(parent, samples)
            for s in samples:
                del self._states[s.request.request_id]
            del self._children[parent], self._num_running[parent]
        return record

    def drain_text(self) -> dict[str, str]:
        """The stream deltas since the last call (once per step, for the StepEvent)."""
        text, self._new_text = self._new_text, {}
        return text

    # ------------------------------------------------------------------ results
    @staticmethod
    def _build_output(parent: str, samples: list[RequestState]) -> RequestOutput:
        first = samples[0].request
        return RequestOutput(
            request_id=parent, prompt=first.prompt, prompt_token_ids=list(first.prompt_token_ids),
            outputs=[CompletionOutput(s.request.sample_index, s.text, list(s.request.output_token_ids),
                                      s.request.status.value, s.request.stop_reason, list(s.token_times),
                                      s.logprobs[:len(s.request.output_token_ids)]
                                      if s.request.params.logprobs is not None else None, s.request.error)
                     for s in samples],
            prompt_logprobs=samples[0].prompt_logprobs if first.params.prompt_logprobs is not None else None,
            num_cached_tokens=max(max(s.request.num_cached_tokens for s in samples), 0),  # later samples hit
            metrics=RequestMetrics(first.arrival_time, first.first_scheduled_time, samples[0].first_token_time,
                                   max(s.finished_time or 0.0 for s in samples),
                                   sum(s.request.num_preemptions for s in samples)))

    def pop_finished(self, request_id: Optional[str] = None) -> list[RequestOutput]:
        """Collected outputs leave the engine: all of them, or the one with ``request_id`` (if finished)."""
        if request_id is not None:
            out = self._finished.pop(request_id, None)
            return [] if out is None else [out]
        done, self._finished = list(self._finished.values()), {}
        return done
