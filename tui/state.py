"""Everything the screen shows, computed from StepEvents alone.

``WatchState`` folds events one at a time: the block map and request table (``EngineView`` from
``minipaged.event_view``), a colour for each request, the event log and the metric histories behind the
sparklines. It never touches the engine, which is why a replayed trace shows exactly what the live run
showed, and why stepping backwards is simply "fold events 0..k-1 again".
"""
from __future__ import annotations

import re
import unicodedata
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional

from minipaged.event_view import EngineView, LatencyFold, busy_label, busy_seconds
from minipaged.events import PREVIEW_GAP, EngineInfo, ScheduledRequest, StepEvent
from minipaged.request_names import RequestNames

# Colours for requests: distinct hues that stay clear of the greys used for free and cached blocks.
PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#a0cbe8", "#8cd17d", "#d37295", "#f1ce63", "#86bcb6", "#d4a6c8", "#ffbe7d")

HISTORY_LEN = 120          # points kept for each sparkline
LOG_LEN = 400              # event log lines kept
RATE_WINDOW = 10           # steps averaged for tokens per second
FINISHED_KEPT = 200        # finished requests remembered (older ones are forgotten: a class runs for hours)
LANE_LEN = 40              # recent steps the host/device lane shows

# Chat-template markup (ChatML's "<|im_start|>user", Llama's "[INST]", "<s>" ...) and the role word after it.
_CHAT_MARKUP = re.compile(r"<\|im_start\|>\w+|<\|(?:system|user|assistant)\|>|<\|[^|>]{1,20}\|>|</?s>|\[/?INST\]")
_UNDRAWABLE = ("Cc", "Cf", "Cn", "Co", "Cs", "Mn", "Me")   # controls, unassigned, lone combining marks


def printable(text: str) -> str:
    """Text as it is safe to draw in a grid of cells: control characters and combining marks (random test
    models emit plenty, and they shift the columns after them) become a middle dot."""
    return "".join("·" if ch not in "\n" and unicodedata.category(ch) in _UNDRAWABLE else ch for ch in text)


def clean_preview(prompt: str, width: int = 0) -> str:
    """A prompt shown on one line: chat-template markers and newlines removed; when ``width`` is given and
    the text is longer, its start and its end, since prompts that share a long prefix (a system prompt)
    differ only at the end."""
    text = " ".join(printable(_CHAT_MARKUP.sub(" ", prompt)).split())
    if width and len(text) > width:
        # Arrivals carry previews the engine has already cut (PREVIEW_GAP in the middle): cut around that
        # gap, not a second one.
        start, _gap, end = text.partition(PREVIEW_GAP) if PREVIEW_GAP in text else (text, "", text)
        head = width // 4
        text = start[:head] + "…" + end[-(width - head - 1):]
    return text


@dataclass(frozen=True)
class LogLine:
    step: int
    kind: str                 # arrive, admit, chunk, hit, evict, preempt, swap, finish
    text: str
    request_id: Optional[str] = None


class Metric:
    """One gauge: the latest value and a bounded history for its sparkline."""

    def __init__(self) -> None:
        self.history: deque[float] = deque(maxlen=HISTORY_LEN)

    def add(self, value: float) -> None:
        self.history.append(value)

    @property
    def last(self) -> Optional[float]:
        return self.history[-1] if self.history else None


def known_tokens(s: ScheduledRequest, ev: StepEvent) -> int:
    """Tokens whose KV a prefill must compute: the prompt, plus the tokens generated before a recompute
    (``num_output_tokens`` counts this step's new token, if it got one)."""
    return s.prompt_len + s.num_output_tokens - (1 if s.request_id in ev.new_token_ids else 0)


def prefill_span(s: ScheduledRequest, ev: StepEvent) -> str:
    """Where a prefill chunk sits: "0→32 of 105", or "0→57 of 44 prompt + 13 generated" for a recompute."""
    known = known_tokens(s, ev)
    extra = f" prompt + {known - s.prompt_len} generated" if known > s.prompt_len else ""
    return f"{s.start}→{s.end} of {s.prompt_len}{extra}"


BUDGET_ZOOM_BELOW = 8       # a step using less than 1/8 of its token budget draws its bar on a smaller scale
BUDGET_MIN_SCALE = 8


def budget_scale(used: int, limit: int) -> int:
    """The tokens the budget bar's whole width stands for: the budget, unless the step used less than an eighth of
    it; then the smallest of 8, 16, 32 ... tokens that the step fills at most half of. On serve's defaults a step
    of 2-13 tokens is under 1% of 2,048 (a sliver in a class trial); zoomed it fills an eighth to a half of the bar,
    and the label says the scale. The web page uses the same rule (fold.mjs's budgetScale)."""
    limit = max(limit, used, 1)
    if used * BUDGET_ZOOM_BELOW >= limit:
        return limit
    scale = BUDGET_MIN_SCALE
    while scale < 2 * used:
        scale *= 2
    return min(scale, limit)


def verification_totals(ev: StepEvent) -> tuple[int, int, int]:
    """Speculative decoding in one step: (requests that verified drafts, drafts, drafts accepted)."""
    verified = [s for s in ev.scheduled if s.draft_token_ids]
    return len(verified), sum(len(s.draft_token_ids) for s in verified), sum(s.num_accepted for s in verified)


# How the log names the free-block eviction order (minipaged.policies); a user's class is named by its path.
EVICTION_WORDS = {"lru": "least recently used", "mru": "most recently freed first"}


def describe_event(ev: StepEvent, before: EngineView) -> list[LogLine]:
    """What happened in one step, in words, in the order it happened. ``before`` is the view before ``ev``."""
    lines: list[LogLine] = []
    bs = before.info.block_size

    def add(kind: str, text: str, rid: Optional[str] = None) -> None:
        lines.append(LogLine(ev.step, kind, text, rid))

    for a in ev.arrivals:
        add("arrive", f"{a.request_id} arrived: {a.prompt_len}-token prompt, max {a.max_tokens} new",
            a.request_id)
    for p in ev.preempted:
        if p.mode == "swap":
            add("preempt", f"{p.request_id} preempted (swap): {p.num_blocks} blocks to CPU", p.request_id)
        else:
            add("preempt", f"{p.request_id} preempted (recompute): {p.num_blocks} blocks freed", p.request_id)
    for rid in ev.swapped_in:
        add("swap", f"{rid} swapped in: {len(ev.kv.swapped_in.get(rid, ()))} blocks from CPU", rid)
    if ev.kv.evicted:
        n = len(ev.kv.evicted)
        order = EVICTION_WORDS.get(before.info.eviction_policy, before.info.eviction_policy)
        add("evict", f"evicted {n} cached block{'s' if n > 1 else ''} ({order}) for new KV")
    for s in ev.scheduled:
        prior = before.requests.get(s.request_id)
        if prior is None or prior.state == "waiting":
            again = " again (recomputes its KV)" if prior is not None and prior.num_preemptions else ""
            add("admit", f"{s.request_id} admitted{again}", s.request_id)
        if s.num_cached_tokens:
            add("hit", f"{s.request_id} cache hit: {s.num_cached_tokens // bs} blocks ({s.num_cached_tokens} "
                       f"tokens) reused", s.request_id)
        if s.kind == "prefill":
            target = known_tokens(s, ev)
            if s.start == s.num_cached_tokens and s.end >= target:
                if target > s.prompt_len:          # a recompute after preemption: the answer so far, too
                    tokens = f"{s.prompt_len} prompt + {target - s.prompt_len} generated tokens"
                    what = f"recomputes the rest of {tokens}" if s.start else f"recomputes {tokens}"
                else:
                    what = "rest of prompt" if s.num_cached_tokens else "whole prompt"
                add("chunk", f"{s.request_id} prefill {s.start}→{s.end} ({what})", s.request_id)
            else:
                last = " (last chunk)" if s.end >= target else ""
                add("chunk", f"{s.request_id} prefill chunk {s.start}→{s.end} of {target}{last}", s.request_id)
    num_verified, drafted, accepted = verification_totals(ev)
    if num_verified:
        produced = accepted + num_verified
        add("spec", f"verified {drafted} draft{'s' if drafted > 1 else ''} of {num_verified} request"
                    f"{'s' if num_verified > 1 else ''}: {accepted} accepted ({accepted / drafted:.0%}), "
                    f"{produced} token{'s' if produced > 1 else ''} in one forward pass")
    if len(ev.constrained) == 1:
        (rid, (allowed, vocab)), = ev.constrained.items()
        add("mask", f"{rid} structured-output mask: {allowed} of {vocab} tokens allowed", rid)
    elif ev.constrained:
        vocab = next(iter(ev.constrained.values()))[1]
        each = ", ".join(f"{rid} {n}" for rid, (n, _vocab) in sorted(ev.constrained.items()))
        add("mask", f"structured-output masks on {len(ev.constrained)} requests, tokens allowed of {vocab}: {each}")
    for f in ev.finished:
        ttft = "" if f.ttft_s is None else f", TTFT {f.ttft_s * 1e3:.0f} ms"
        add("finish", f"{f.request_id} finished ({f.finish_reason}): {f.num_output_tokens} tokens{ttft}",
            f.request_id)
    return lines


class WatchState:
    """The fold of events 0..k: view, colours, log and metrics. Rebuild it to go back in time."""

    def __init__(self, info: EngineInfo) -> None:
        self.info = info
        self.view = EngineView(info)
        self.colours: dict[str, str] = {}
        self._names = RequestNames()
        self.short_names: dict[str, str] = self._names.names   # request id -> r0, r1 ... (what every view shows)
        self.arrival_order: list[str] = []
        self.num_arrived = 0             # colours go by it (arrival_order forgets finished requests)
        self._finished_order: deque[str] = deque()
        self.log: deque[LogLine] = deque(maxlen=LOG_LEN)
        self.num_events = 0
        self.kv_usage = Metric()         # share of GPU blocks in use (cached-but-free counts as free)
        self.hit_rate = Metric()         # prefix-cache hit rate, cumulative
        self.tokens_per_s = Metric()     # generated tokens per second of engine time (pauses excluded)
        self.step_ms = Metric()
        # Latencies on the engine's clock (the sum of step durations), so that pausing the TUI or a slow
        # playback speed does not count: TTFT from the start of the step a request arrived before to the end
        # of the step that gave its first token (one point each); ITL, per step, the mean gap since each
        # decoding request's previous token.
        self.ttft_ms = Metric()
        self.itl_ms = Metric()
        self.engine_s = 0.0
        # Speculative decoding, per step with drafts: accepted / drafted, and tokens per verification
        # (accepted drafts + the target's own token; 1.0 means speculation bought nothing).
        self.acceptance_rate = Metric()
        self.acceptance_length = Metric()
        self._latency = LatencyFold()
        self._recent: deque[tuple[int, float]] = deque(maxlen=RATE_WINDOW)
        # Why the GPU waits (lessons/lesson10_gpu_waits.md): the share of the last RATE_WINDOW steps' wall time the
        # device was busy (on a CPU: the forward pass ran; ``busy_label`` says which), and per recent step the
        # shares of its wall time the host worked and the device (forward) was busy: the lane. Without async
        # output processing they add up to the step; with it they overlap. Empty for traces recorded before steps
        # carried these times.
        self.device_busy = Metric()
        self.lane: deque[tuple[float, float]] = deque(maxlen=LANE_LEN)
        self.busy_label = "forward"
        self._recent_busy: deque[tuple[float, float]] = deque(maxlen=RATE_WINDOW)

    @classmethod
    def from_events(cls, info: EngineInfo, events: Iterable[StepEvent]) -> "WatchState":
        state = cls(info)
        for ev in events:
            state.apply(ev)
        return state

    def colour(self, request_id: str) -> str:
        """A request's colour: by arrival order, so live and replayed runs colour alike."""
        return self.colours.get(request_id, "#888888")

    def _give_name(self, request_id: str, name: Optional[str] = None) -> None:
        """The name its arrival carries (the engine names requests: every view says the same), or, in a trace
        recorded before arrivals carried names, one given here the same way (minipaged/request_names.py)."""
        self._names.give(request_id, name)

    def _forget_name(self, request_id: str) -> None:
        self._names.forget(request_id)

    def short_name(self, request_id: str) -> str:
        return self.short_names.get(request_id, request_id)

    def named(self, line: "LogLine") -> str:
        """A log line as the views show it: a line about one request starts with its name, not its id."""
        if line.request_id and line.text.startswith(line.request_id):
            return self.short_name(line.request_id) + line.text[len(line.request_id):]
        return line.text

    def apply(self, ev: StepEvent) -> None:
        for a in ev.arrivals:
            if a.request_id not in self.colours:
                self.colours[a.request_id] = PALETTE[self.num_arrived % len(PALETTE)]
                self._give_name(a.request_id, a.name)
                self.arrival_order.append(a.request_id)
                self.num_arrived += 1
        self.log.extend(describe_event(ev, self.view))
        self.view.apply(ev)
        self.num_events += 1
        self._forget_old_finished(ev)

        total = ev.num_total_blocks or self.info.num_blocks
        self.kv_usage.add((total - ev.num_free_blocks) / total if total else 0.0)
        self.hit_rate.add(float(ev.counters.get("prefix_cache_hit_rate", 0.0)))
        self.step_ms.add(ev.duration_s * 1e3)
        self._recent.append((sum(len(t) for t in ev.new_token_ids.values()), ev.duration_s))
        busy = sum(d for _n, d in self._recent)
        self.tokens_per_s.add(sum(n for n, _d in self._recent) / busy if busy > 0 else 0.0)
        self._track_latencies(ev)
        self._track_busy(ev)
        num_verified, drafted, accepted = verification_totals(ev)
        if num_verified:
            self.acceptance_rate.add(accepted / drafted)
            self.acceptance_length.add(1 + accepted / num_verified)

    def _forget_old_finished(self, ev: StepEvent) -> None:
        """Keep the FINISHED_KEPT most recently finished requests: a long session's table, colours and arrival
        order stay bounded (the web page folds the same way, fold.mjs)."""
        self._finished_order.extend(f.request_id for f in ev.finished)
        if len(self._finished_order) <= FINISHED_KEPT:
            return
        gone = set()
        while len(self._finished_order) > FINISHED_KEPT:
            rid = self._finished_order.popleft()
            req = self.view.requests.get(rid)
            if req is not None and req.state == "finished":
                del self.view.requests[rid]
                self.colours.pop(rid, None)
                self._forget_name(rid)
                gone.add(rid)
        self.arrival_order = [rid for rid in self.arrival_order if rid not in gone]

    def _track_busy(self, ev: StepEvent) -> None:
        busy = busy_seconds(ev)
        if busy is None or ev.host_s is None or ev.duration_s <= 0:   # an old trace, or a late watcher's snapshot
            return
        self.busy_label = busy_label(ev)
        self._recent_busy.append((busy, ev.duration_s))
        wall = sum(d for _b, d in self._recent_busy)
        self.device_busy.add(min(1.0, sum(b for b, _d in self._recent_busy) / wall))
        self.lane.append((min(1.0, ev.host_s / ev.duration_s), min(1.0, busy / ev.duration_s)))

    def _track_latencies(self, ev: StepEvent) -> None:
        arrived = self.engine_s                            # the step's requests arrived just before it
        self.engine_s += ev.duration_s
        ttfts, gaps = self._latency.apply(ev, self.engine_s, lambda _arrival: arrived)
        for ttft in ttfts:
            self.ttft_ms.add(ttft * 1e3)
        if gaps:
            self.itl_ms.add(sum(gaps) / len(gaps) * 1e3)

    @property
    def last_event(self) -> Optional[StepEvent]:
        return self.view.last_event

    def queues(self) -> dict[str, list[str]]:
        """Request ids by queue, in the engine's order (finished: most recent first)."""
        ev = self.last_event
        finished = [rid for rid in reversed(self.arrival_order) if self.view.requests[rid].state == "finished"]
        if ev is None:
            return {"running": [], "waiting": [], "swapped": [], "finished": finished}
        return {"running": list(ev.running), "waiting": list(ev.waiting), "swapped": list(ev.swapped),
                "finished": finished}

    def ordered_requests(self) -> list[str]:
        """All requests in the order the request table lists them."""
        q = self.queues()
        seen = q["running"] + q["swapped"] + q["waiting"]
        rest = [rid for rid in self.arrival_order if rid not in set(seen) and rid not in set(q["finished"])]
        return seen + rest + q["finished"]
