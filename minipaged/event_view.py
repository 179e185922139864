"""The observers' side of events: folding StepEvents into what a person is shown.

``EngineView`` rebuilds the block map and the request table from events alone (the tests check it agrees with
the engine's own block manager after every step); ``LatencyFold`` turns them into time to first token and
the gaps between tokens; ``busy_seconds`` and ``step_probability`` read one event for a gauge or a colour.
The TUI, replay, the metrics, the server's late-watcher snapshot and the lessons share them; the web page's
fold.mjs mirrors them line by line.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

from .events import EngineInfo, KVChanges, PrefixLookup, RequestArrival, StepEvent


def busy_seconds(ev: StepEvent) -> Optional[float]:
    """How long the step kept the thing that computes the model busy: the device's time on CUDA, the forward
    call's time on a CPU (where the host computes the forward itself); None in an old trace. Beside
    ``duration_s`` it is the "busy" gauge: the share of the step the device did not wait for the host. The web
    page's fold.mjs (busySeconds) says the same."""
    return ev.device_s if ev.device_s is not None else ev.forward_s


def busy_label(ev: StepEvent) -> str:
    """What ``busy_seconds`` counts: "device" (CUDA events) or "forward" (a CPU's forward pass)."""
    return "device" if ev.device_s is not None else "forward"


class LatencyFold:
    """Time to first token and the gaps between tokens, from StepEvents, on whatever clock the caller keeps
    (the TUI leaves its pauses out; metrics use the engine's wall clock).

    ``apply`` returns the TTFTs of requests whose first token came in the event and the gaps of requests
    that got another one. Finished requests are forgotten, so a long session does not grow.
    """

    def __init__(self) -> None:
        self._arrived: dict[str, float] = {}
        self._last_token: dict[str, float] = {}

    def apply(self, ev: StepEvent, now: float,
              arrival_time: Callable[[RequestArrival], float]) -> tuple[list[float], list[float]]:
        for a in ev.arrivals:
            self._arrived[a.request_id] = arrival_time(a)
        ttfts, gaps = [], []
        for rid in ev.new_token_ids:
            previous = self._last_token.get(rid)
            if previous is not None:
                gaps.append(now - previous)
            elif rid in self._arrived:
                ttfts.append(now - self._arrived[rid])
            self._last_token[rid] = now
        for f in ev.finished:
            self._arrived.pop(f.request_id, None)
            self._last_token.pop(f.request_id, None)
        return ttfts, gaps


def step_probability(logprobs: Optional[list[float]]) -> Optional[float]:
    """One probability for a step's tokens (their geometric mean); None if the step carried none."""
    if not logprobs:
        return None
    return math.exp(sum(logprobs) / len(logprobs))


@dataclass
class RequestView:
    """What an observer knows of one request from events alone."""

    request_id: str
    prompt_len: int
    max_tokens: int
    prompt: str
    state: str = "waiting"       # waiting, running, swapped, finished
    num_computed: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    text: str = ""
    # (characters of text, probability of the tokens that brought them) per step, when the request asked for
    # log-probabilities: what the TUI colours the output by. None: text without a probability (a flush).
    text_probs: list[tuple[int, Optional[float]]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    num_preemptions: int = 0
    blocks: list[int] = field(default_factory=list)
    cpu_blocks: list[int] = field(default_factory=list)
    prefix_lookup: Optional[PrefixLookup] = None   # its latest admission's (a recompute is admitted again)
    name: Optional[str] = None                       # as its arrival named it (request_names.py)


class EngineView:
    """Folds StepEvents into the block map and request table; used by the TUI, replay and tests.

    Invariant checked by the tests: after every step, this view agrees with the engine's own block manager.
    """

    def __init__(self, info: EngineInfo) -> None:
        self.info = info
        self.block_owners: list[list[str]] = [[] for _ in range(info.num_blocks)]  # ref count = len(owners)
        self.block_cached: list[bool] = [False] * info.num_blocks
        self.cpu_block_owner: list[Optional[str]] = [None] * info.num_cpu_blocks
        self.requests: dict[str, RequestView] = {}
        self.last_event: Optional[StepEvent] = None
        self.step = 0

    def apply(self, ev: StepEvent) -> None:
        for a in ev.arrivals:
            shared = self.requests.get(a.prompt_of) if a.prompt_of is not None else None
            prompt = shared.prompt if shared is not None else a.prompt
            self.requests[a.request_id] = RequestView(a.request_id, a.prompt_len, a.max_tokens, prompt,
                                                      prefix_lookup=a.prefix_lookup, name=a.name)
        kv = ev.kv
        for rid, pairs in kv.swapped_out.items():
            for _gpu, cpu in pairs:
                self.cpu_block_owner[cpu] = rid
            if rid in self.requests:
                self.requests[rid].cpu_blocks = [cpu for _g, cpu in pairs]
        self._release(kv.freed)
        for b in kv.evicted + kv.uncached:
            self.block_cached[b] = False
        for rid, pairs in kv.swapped_in.items():
            for cpu, gpu in pairs:
                self.cpu_block_owner[cpu] = None
                self.block_owners[gpu].append(rid)
            if rid in self.requests:
                self.requests[rid].blocks = [gpu for _c, gpu in pairs]
                self.requests[rid].cpu_blocks = []
        for rid, blocks in kv.allocated.items():
            for b in blocks:
                self.block_owners[b].append(rid)
            if rid in self.requests:
                self.requests[rid].blocks.extend(blocks)
        for b in kv.cached:
            self.block_cached[b] = True
        self._release(kv.freed_on_finish)
        for p in ev.preempted:
            req = self.requests.get(p.request_id)
            if req is not None:
                req.num_preemptions += 1
                if p.mode == "recompute":
                    req.num_computed = 0
        for s in ev.scheduled:
            req = self.requests.get(s.request_id)
            if req is not None:
                req.num_computed = s.computed_end
                req.num_output_tokens = s.num_output_tokens
                if s.num_cached_tokens:
                    req.num_cached_tokens = s.num_cached_tokens
                if s.prefix_lookup is not None:
                    req.prefix_lookup = s.prefix_lookup
        for rid, text in ev.new_text.items():
            if rid in self.requests:
                self.requests[rid].text += text
                if ev.new_logprobs.get(rid) or self.requests[rid].text_probs:
                    self.requests[rid].text_probs.append((len(text), step_probability(ev.new_logprobs.get(rid))))
        for rid in ev.waiting:
            if rid in self.requests:
                self.requests[rid].state = "waiting"
        for rid in ev.running:
            if rid in self.requests:
                self.requests[rid].state = "running"
        for rid in ev.swapped:
            if rid in self.requests:
                self.requests[rid].state = "swapped"
        for f in ev.finished:
            req = self.requests.get(f.request_id)
            if req is not None:
                req.state = "finished"
                req.finish_reason = f.finish_reason
                req.num_output_tokens = f.num_output_tokens
        self.last_event = ev
        self.step = ev.step

    def _release(self, freed: dict[str, list[int]]) -> None:
        for rid, blocks in freed.items():
            for b in blocks:
                if rid in self.block_owners[b]:
                    self.block_owners[b].remove(rid)
            req = self.requests.get(rid)
            if req is not None:
                gone = set(blocks)
                req.blocks = [b for b in req.blocks if b not in gone]

    def block_state(self, block_id: int) -> str:
        """One of: free, cached (free but reusable), used, shared (ref count > 1)."""
        owners = self.block_owners[block_id]
        if not owners:
            return "cached" if self.block_cached[block_id] else "free"
        return "shared" if len(owners) > 1 else "used"

    def num_free_blocks(self) -> int:
        return sum(1 for owners in self.block_owners if not owners)


def snapshot_event(view: EngineView) -> StepEvent:
    """The engine's current state as one StepEvent, so that a watcher joining late, folding it into an empty
    EngineView, draws the same block map and request table as one that watched from the start: every live
    request "arrives" with its text so far, its blocks are allocated, cached blocks are marked cached."""
    last = view.last_event
    live = list(view.requests.values())
    kv = KVChanges(allocated={r.request_id: list(r.blocks) for r in live if r.blocks},
                   cached=[b for b, cached in enumerate(view.block_cached) if cached],
                   swapped_out={r.request_id: [(-1, cpu) for cpu in r.cpu_blocks] for r in live if r.cpu_blocks})
    by_state = {state: tuple(r.request_id for r in live if r.state == state) for state in ("waiting", "running",
                                                                                             "swapped")}
    return StepEvent(
        step=view.step, time_s=last.time_s if last else 0.0, duration_s=0.0, schedule_s=0.0, model_s=0.0,
        budget_limit=view.info.max_num_batched_tokens, budget_used=0, max_num_seqs=view.info.max_num_seqs,
        arrivals=tuple(RequestArrival(r.request_id, r.prompt_len, r.max_tokens, r.prompt,
                                      prefix_lookup=r.prefix_lookup, name=r.name) for r in live),
        new_text={r.request_id: r.text for r in live if r.text}, kv=kv,
        num_free_blocks=view.num_free_blocks(), num_cached_free_blocks=sum(
            1 for b, owners in enumerate(view.block_owners) if not owners and view.block_cached[b]),
        num_total_blocks=view.info.num_blocks,
        num_free_cpu_blocks=sum(1 for owner in view.cpu_block_owner if owner is None),
        num_total_cpu_blocks=view.info.num_cpu_blocks, waiting=by_state["waiting"], running=by_state["running"],
        swapped=by_state["swapped"], counters=dict(last.counters) if last else {})
