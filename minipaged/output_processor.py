"""Tokens out: text, stop strings, the step's per-request deltas and the ``RequestOutput`` a caller gets back.

The scheduler decides everything a token alone decides (EOS, stop token ids, lengths). What needs *text*
happens here, after each step (as in vLLM v1's ``OutputProcessor``):
  * each request's text grows by an ``IncrementalDetokenizer`` (constant work per token);
  * stop strings are searched for in the new text only; a hit cuts the text before the stop string (and the
    tokens after the one that completed it) and asks the engine core to finish the request, as vLLM v1's
    front end sends an abort (it also overrides a length finish in the same token);
  * clients get their text as deltas. Until a request finishes, the last ``len(longest stop) - 1``
    characters are held back: they may be the start of a stop string, which the final text leaves out;
  * ``n > 1`` samples of one prompt run as separate requests (``id.0`` ... ``id.n-1``, named by the input
    processor); here they are gathered back: one ``RequestDelta`` per request a step, with a ``SampleDelta``
    per sample that changed, and one ``RequestOutput`` once the last of them finishes.

``drain()`` ends a step: it returns the step's ``RequestDelta``s (the engine's outputs, for clients) and what
observers are shown of the same change (tokens, text and log-probabilities per sample, for the ``StepEvent``).
Nobody else spells the sample-id scheme or keeps per-request output state. It reads requests, never writes them:
what a client sees (tokens, text, finish reason) is kept here (``fail_request`` records why a request whose
text could not be made fails, as every part that fails one request does).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .detokenizer import IncrementalDetokenizer
from .outputs import (CompletionOutput, Logprob, PositionLogprobs, RequestDelta, RequestMetrics, RequestOutput,
                      SampleDelta, TokenLogprobs)
from .request import Request, RequestStatus, fail_request


def sample_ids(request_id: str, n: int) -> list[str]:
    """The ids the n samples of one request run under (the input processor names its requests with them): the
    request's own id when n is 1, else ``id.0`` ... ``id.n-1``. Clients never see them: deltas and outputs
    carry the request's id and each sample's index."""
    return [request_id] if n == 1 else [f"{request_id}.{i}" for i in range(n)]


@dataclass(slots=True)
class SampleChange:
    """What one sample got since the last ``drain()``: its ``SampleDelta`` in the making."""

    parent_id: str
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    text: str = ""
    finish_reason: Optional[str] = None


@dataclass(frozen=True)
class DrainedStep:
    """A step's outputs for clients, and the same change as observers see it (keyed by sample id)."""

    deltas: tuple[RequestDelta, ...]
    token_ids: dict[str, list[int]]            # sample id -> its new tokens (StepEvent.new_token_ids)
    text: dict[str, str]                       # sample id -> its new text (StepEvent.new_text)
    logprobs: dict[str, list[float]]           # sample id -> each new token's log-probability (new_logprobs)


@dataclass
class RequestState:
    """What the output side keeps for one running request (one sample)."""

    request: Request
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)   # the output tokens, none after a stop string's
    stop_string: Optional[str] = None  # the stop string that ended it (it wins over a length finish)
    text: str = ""                     # the output text, cut before a stop string once one is found
    num_streamed_chars: int = 0        # text[:this] has gone out in deltas
    token_times: list[float] = field(default_factory=list)
    finished_time: Optional[float] = None
    logprobs: list[PositionLogprobs] = field(default_factory=list)             # when the request asked
    prompt_logprobs: list[Optional[PositionLogprobs]] = field(default_factory=list)

    @property
    def first_token_time(self) -> Optional[float]:
        return self.token_times[0] if self.token_times else None

    @property
    def finish_reason(self) -> str:
        return "stop" if self.stop_string is not None else self.request.status.value

    @property
    def stop_reason(self) -> Optional[str | int]:
        return self.stop_string if self.stop_string is not None else self.request.stop_reason


class OutputProcessor:
    """Owns every running request's output state, from its first token to the delta that carries its output."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, RequestState] = {}       # sample id -> its state, until its request is done
        self._children: dict[str, list[str]] = {}        # request id -> its sample ids (n > 1: id.0 ... id.n-1)
        self._num_running: dict[str, int] = {}           # request id -> its samples not finished yet
        self._changes: dict[str, SampleChange] = {}      # sample id -> what it got since the last drain
        self._finished: dict[str, RequestOutput] = {}    # request id -> its output, finished since the last drain
        self._withheld: set[str] = set()                 # ids the caller aborted: their changes are not delivered
        self._failed: list[Request] = []                 # samples whose text could not be made this step
        self._delivered: set[str] = set()                # request ids that got a delta already (prompt logprobs
                                                         # travel in the first)

    # ------------------------------------------------------------------ bookkeeping
    def add_requests(self, parent_id: str, requests: list[Request]) -> None:
        self._children[parent_id] = [r.request_id for r in requests]
        self._num_running[parent_id] = len(requests)
        for req in requests:
            state = RequestState(req, IncrementalDetokenizer(self.tokenizer, req.params.skip_special_tokens))
            if req.params.prompt_logprobs is not None:
                state.prompt_logprobs = [None] * req.num_prompt_tokens
            self._states[req.request_id] = state

    def id_in_use(self, request_id: str) -> bool:
        return request_id in self._states or request_id in self._children

    def unfinished(self, request_id: str) -> list[Request]:
        """The samples of a request id (or the one sample with that id) that are still running."""
        ids = self._children.get(request_id, [request_id])
        return [self._states[rid].request for rid in ids
                if rid in self._states and not self._states[rid].request.is_finished]

    def _change(self, state: RequestState) -> SampleChange:
        req = state.request
        change = self._changes.get(req.request_id)
        if change is None:
            change = self._changes[req.request_id] = SampleChange(req.parent_id or req.request_id, req.sample_index)
        return change

    # ------------------------------------------------------------------ each step
    def process_tokens(self, new_token_ids: dict[str, list[int]], now: float,
                       logprobs: Optional[dict[str, list[TokenLogprobs]]] = None) -> list[tuple[Request, str]]:
        """Grow each request's text by its new tokens (and log-probabilities, for those that asked); returns
        the requests a stop string ends, with it. Tokens that came after the one completing it (speculative
        decoding appends several a step) are left out, as if generated one at a time."""
        stopped: list[tuple[Request, str]] = []
        logprobs = logprobs or {}
        for rid, tokens in new_token_ids.items():
            state = self._states[rid]
            try:
                stop = self._add_tokens(state, tokens, now, logprobs.get(rid))
            except Exception as exc:          # ids its tokenizer cannot decode: this request ends, not the step
                fail_request(state.request, f"turning its tokens into text failed ({type(exc).__name__}: {exc})")
                self._failed.append(state.request)
                continue
            if stop is not None:
                state.stop_string = stop
                stopped.append((state.request, stop))
        return stopped

    def take_failed(self) -> list[Request]:
        """The samples whose new tokens could not be turned into text this step (each carries its error): the
        engine aborts them; the other requests go on."""
        failed, self._failed = self._failed, []
        return failed

    def _add_tokens(self, state: RequestState, tokens: list[int], now: float,
                    token_logprobs: Optional[list[TokenLogprobs]]) -> Optional[str]:
        """One request's new tokens: its text, and the stop string if one ends it."""
        req = state.request
        change = self._change(state)
        if len(tokens) == 1 and not req.params.stop and token_logprobs is None:
            # The usual step: one token, no stop string to look for, no log-probabilities to keep. What the
            # loop below does then, without its work: nothing is held back, so the new text goes out whole.
            state.token_times.append(now)
            state.token_ids.append(tokens[0])
            change.token_ids.append(tokens[0])
            piece = state.detokenizer.add_tokens(tokens)
            if piece:
                state.text += piece
                if not req.is_finished:               # (a finished request's text goes out in finish())
                    change.text += piece
                    state.num_streamed_chars = len(state.text)
            return None
        token_logprobs = token_logprobs or ()
        for i, token in enumerate(tokens):
            state.token_times.append(now)
            state.token_ids.append(token)
            change.token_ids.append(token)
            if i < len(token_logprobs):
                position = self.position_logprobs(token_logprobs[i])
                if req.params.output_kind == "cumulative":     # (a "delta" caller has them from the deltas)
                    state.logprobs.append(position)
                change.logprobs.append(position)
            old_len = len(state.text)
            state.text += state.detokenizer.add_tokens([token])
            # vLLM v1: no stop string ends a request within its first min_tokens tokens; one that starts in them
            # and completes with a later token still does (the search reaches back len(stop) - 1 characters).
            held = req.status is RequestStatus.FINISHED_STOPPED or len(state.token_ids) <= req.params.min_tokens
            stop = None if held else self._find_stop(state, old_len)
            if stop is not None:
                return stop
        if not req.is_finished:
            self._stream(state, finished=False)
        return None

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
        if state is None or state.request is not req:    # ended (its id may have a new owner already)
            return
        for i, entry in enumerate(entries):
            state.prompt_logprobs[first + i] = self.position_logprobs(entry)

    @staticmethod
    def _find_stop(state: RequestState, old_len: int) -> Optional[str]:
        """The earliest stop string in the text, searching only where the new text could complete one;
        cuts the text before it (after it with ``include_stop_str_in_output``)."""
        stops = state.request.params.stop
        if not stops:
            return None
        search_from = max(0, old_len - max(len(s) for s in stops) + 1)
        hits = [(i, s) for i, s in ((state.text.find(s, search_from), s) for s in stops) if i >= 0]
        if not hits:
            return None
        index, stop = min(hits)
        state.text = state.text[:index + (len(stop) if state.request.params.include_stop_str_in_output else 0)]
        return stop

    def _stream(self, state: RequestState, finished: bool) -> None:
        """Queue the text that can go out now (see the module docstring for what is held back)."""
        stops = state.request.params.stop
        hold = 0 if finished or not stops else max(len(s) for s in stops) - 1
        end = max(state.num_streamed_chars, len(state.text) - hold)
        delta = state.text[state.num_streamed_chars:end]
        state.num_streamed_chars = end
        if delta:
            self._change(state).text += delta

    def finish(self, req: Request, now: float, deliver: bool = True) -> RequestState:
        """Record a finished (or aborted) sample: flush its held-back text, and once all samples of its
        request are done, build the caller's ``RequestOutput``. ``deliver=False`` (the caller aborted it, so
        nobody waits for it): its delta and output are not delivered. Returns its state (observers' record)."""
        state = self._states[req.request_id]
        first_finish = state.finished_time is None
        state.finished_time = now
        self._stream(state, finished=True)
        self._change(state).finish_reason = state.finish_reason
        if not deliver:
            self._withheld.add(req.request_id)
        parent = req.parent_id or req.request_id
        self._num_running[parent] -= first_finish       # a count, not a walk over the samples: aborting
        if self._num_running[parent] == 0:              # n samples stays O(n), not O(n^2)
            samples = [self._states[rid] for rid in self._children[parent]]
            if deliver:                                 # (its first delta carries the prompt's log-probabilities)
                self._finished[parent] = self._build_output(parent, samples, parent not in self._delivered)
            else:                                       # nobody waits for it: its id may be used again
                self._delivered.discard(parent)
            for s in samples:
                del self._states[s.request.request_id]
            del self._children[parent], self._num_running[parent]
        return state

    def drain(self) -> DrainedStep:
        """End the step: each request's delta (what its samples got, its output if it finished), and the
        observers' view of the same change."""
        changes, self._changes = self._changes, {}
        finished, self._finished = self._finished, {}
        withheld, self._withheld = self._withheld, set()
        samples: dict[str, list[SampleDelta]] = {}
        for sample_id, c in changes.items():
            if sample_id not in withheld:
                samples.setdefault(c.parent_id, []).append(SampleDelta(
                    c.index, c.text, tuple(c.token_ids), tuple(c.logprobs), c.finish_reason))
        deltas = []
        for parent, parent_samples in samples.items():
            output = finished.get(parent)
            prompt_logprobs = None
            if parent not in self._delivered:
                prompt_logprobs = output.prompt_logprobs if output is not None else self._prompt_logprobs(parent)
                self._delivered.add(parent)
            if output is not None:
                self._delivered.discard(parent)
            if len(parent_samples) > 1:
                parent_samples.sort(key=lambda d: d.index)
            deltas.append(RequestDelta(parent, tuple(parent_samples), prompt_logprobs, output))
        return DrainedStep(
            tuple(deltas), {sid: c.token_ids for sid, c in changes.items() if c.token_ids},
            {sid: c.text for sid, c in changes.items() if c.text},
            {sid: [position[token].logprob for position, token in zip(c.logprobs, c.token_ids)]
             for sid, c in changes.items() if c.logprobs})

    def _prompt_logprobs(self, parent: str) -> Optional[list[Optional[PositionLogprobs]]]:
        state = self._states.get(self._children.get(parent, [""])[0])
        if state is None or state.request.params.prompt_logprobs is None:
            return None
        return list(state.prompt_logprobs)

    # ------------------------------------------------------------------ results
    @staticmethod
    def _build_output(parent: str, samples: list[RequestState], first_delta: bool) -> RequestOutput:
        """The request's RequestOutput; a "delta" one keeps its prompt's log-probabilities only where it ends in
        its first delta (``first_delta``), which carries them from the output (``drain``)."""
        first = samples[0].request
        if first.params.output_kind == "delta":           # the deltas carried the tokens: how each sample ended
            outputs = [CompletionOutput(s.request.sample_index, "", [], s.finish_reason, s.stop_reason,
                                        error=s.request.error, num_tokens=len(s.token_ids)) for s in samples]
        else:
            outputs = [CompletionOutput(s.request.sample_index, s.text, list(s.token_ids),
                                        s.finish_reason, s.stop_reason, list(s.token_times),
                                        s.logprobs[:len(s.token_ids)]
                                        if s.request.params.logprobs is not None else None, s.request.error,
                                        len(s.token_ids))
                       for s in samples]
        return RequestOutput(
            request_id=parent, prompt=first.prompt, prompt_token_ids=list(first.prompt_token_ids), outputs=outputs,
            prompt_logprobs=samples[0].prompt_logprobs
            if first.params.prompt_logprobs is not None and (first.params.output_kind == "cumulative" or first_delta)
            else None,
            num_cached_tokens=max(max(s.request.num_cached_tokens for s in samples), 0),  # later samples hit
            metrics=RequestMetrics(first.arrival_time, first.first_scheduled_time, samples[0].first_token_time,
                                   max(s.finished_time or 0.0 for s in samples),
                                   sum(s.request.num_preemptions for s in samples)))
