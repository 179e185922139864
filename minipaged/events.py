"""StepEvent: the one window onto the engine.

Each ``Engine.step()`` makes one frozen, JSON-serialisable ``StepEvent`` (``StepResult.event``, and every
subscriber's) saying what was scheduled, which KV blocks changed hands, what was cached, evicted, preempted,
swapped and finished, and how long it took. The TUI, traces, metrics and lessons read these events and nothing
else. Events only observe: clients get their tokens from ``StepResult.outputs`` (minipaged/outputs.py); the
text and tokens an event shows are the same change, keyed by sample id, for drawing. ``EngineView``
(minipaged/event_view.py) shows that this is enough: it rebuilds the block map and the request table from
events alone.

This module is the schema only: plain dataclasses and their JSON round trip (``StepEvent.to_json`` and
``from_dict``, which a trace file and the server's event stream share). Writing and reading trace files is
minipaged/trace.py; folding events into a view is minipaged/event_view.py. None of them imports torch: thin
clients (``watch --attach``, ``export-html``) read events without the engine.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Optional

import msgspec


@dataclass(frozen=True)
class EngineInfo:
    """What does not change during a run: shown in headers, needed to draw an empty block map."""

    model: str
    num_blocks: int
    num_cpu_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    policy: str
    preemption_mode: str
    kv_bytes_per_token: int
    device: str
    dtype: str
    attention_backend: str
    num_threads: Optional[int] = None    # torch's CPU threads (None: a trace recorded before it was kept)
    speculative: Optional[str] = None    # speculative decoding, described ("ngram k=3 (n-grams 2-4)"); None: off
    num_speculative_tokens: int = 0      # k: drafts per request per step
    speculative_config: Optional[dict] = None   # the whole configuration, vLLM's keys, defaults filled in
    parallel: Optional[str] = None       # the rank layout, "tp=3: 3 heads, 1 KV head per rank" (None: one rank)
    scheduling_policy: str = "fcfs"      # minipaged.policies: a name, or path/to/file.py:ClassName
    preemption_victim: str = "newest"
    eviction_policy: str = "lru"
    quantization: Optional[str] = None   # "int8": weight-only int8 (kernels/int8.py); None: the weights' own dtype
    weight_bytes: Optional[int] = None   # bytes of the weights the model computes with (rank 0's); None: old trace
    async_output_processing: bool = False   # outputs processed while the next forward pass runs (one step late)
    fair_share: bool = False             # fair share by client (--fair-share): lesson 8 tells its variant by it

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "EngineInfo":
        """An engine header as a trace or the event stream writes it (``type`` may be there). Keys of fields
        since renamed are read under their new name, so traces recorded before a rename still load."""
        body = {RENAMED_INFO_KEYS.get(k, k): v for k, v in d.items() if k != "type"}
        return EngineInfo(**body)


# Old EngineInfo keys -> their names now. "async_scheduling" named the option after vLLM v1's async scheduling,
# which minipaged does not do (it is v0's async output processing: lessons/lesson10_gpu_waits.md).
RENAMED_INFO_KEYS = {"async_scheduling": "async_output_processing"}


PROMPT_PREVIEW_CHARS = 1000    # the most prompt text one arrival carries (start and end, PREVIEW_GAP between)
PREVIEW_GAP = " … "            # where a preview leaves out the prompt's middle


def prompt_preview(text: str, limit: int = PROMPT_PREVIEW_CHARS) -> str:
    """``text`` if it is at most ``limit`` characters, else its start and its end around PREVIEW_GAP: prompts
    that share a long prefix (a system prompt) differ at the end. Why bounded: every watcher gets every
    arrival, and a 500 KB prompt sent to a class of browsers froze each of them (issue 39); the whole text
    is there on demand (``GET /v1/events/prompts/{id}``, behind the API key like the rest)."""
    if len(text) <= limit:
        return text
    head = limit // 2
    return text[:head] + PREVIEW_GAP + text[-(limit - head - len(PREVIEW_GAP)):]


@dataclass(frozen=True)
class RequestArrival:
    request_id: str
    prompt_len: int
    max_tokens: int
    prompt: str                  # the prompt as text (token-id prompts decoded), at most PROMPT_PREVIEW_CHARS
    arrival_s: Optional[float] = None   # when add_request took it, on StepEvent.time_s's clock (None: old trace)
    # The n samples of one request share one prompt: it is sent once, with the first; the others name it here
    # (an earlier arrival of the same event) and carry prompt "". None: this arrival carries its own.
    prompt_of: Optional[str] = None
    # Only in a late watcher's snapshot (serve/async_engine.py): the lookup it was admitted with, long ago.
    prefix_lookup: Optional[PrefixLookup] = None
    # The name every view shows it by (r0, r1 ...: request_names.py), given by the engine's recorder. None: a
    # trace recorded before arrivals carried names (the watchers name it themselves, the same way).
    name: Optional[str] = None

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "RequestArrival":
        d = dict(d)
        if "prompt_preview" in d:           # traces recorded before the engine stopped shortening prompts
            d["prompt"] = d.pop("prompt_preview")
        return RequestArrival(**{**d, "prefix_lookup": _lookup(d.get("prefix_lookup"))})


@dataclass(frozen=True)
class PrefixLookup:
    """What the prefix cache answered when a request was admitted: how many of its full blocks hit, and why
    the first one that did not hit missed (``KVRecorder`` in minipaged/kv_recorder.py, from the block pool's
    change log).

    ``reason`` is one of:

    * ``"all_hit"``: every full block was cached (only full blocks are cached: the tail is computed anyway);
    * ``"never"``: no block ever held that block's hash (said only while the engine's bounded record of
      evictions has forgotten none, so it is exact);
    * ``"evicted"``: it was cached, and the allocation for request ``evicted_for`` took its block at step
      ``evicted_step``;
    * ``"reset"``: it was cached until ``reset_prefix_cache`` dropped every hash, at step ``evicted_step``;
    * ``"differs"``: the request's tokens differ from every cached continuation of its hits from token
      ``differs_at`` on (the cached chain it shares is ``differs_at`` tokens long);
    * ``"unrecorded"``: not cached, nor among the recent evictions the engine remembers (a bounded record):
      never computed, or evicted before those.
    """

    num_blocks: int              # full blocks of the request's tokens when it was admitted
    num_hit_blocks: int          # the first num_hit_blocks of them were cached
    reason: str
    evicted_step: Optional[int] = None
    evicted_for: Optional[str] = None
    differs_at: Optional[int] = None


def describe_prefix_lookup(lookup: PrefixLookup) -> str:
    """One short line for a person (a narrow TUI panel keeps it in view): the TUI's output panel and the web
    page (fold.mjs's describeLookup) say the same. Blocks are full blocks: only those are cached."""
    hits = f"{lookup.num_hit_blocks}/{lookup.num_blocks} blocks hit"
    if lookup.reason == "all_hit":
        return hits
    why = {"never": "never computed",
           "evicted": f"evicted at step {lookup.evicted_step} for {lookup.evicted_for}",
           "reset": f"cache reset at step {lookup.evicted_step}",
           "differs": ("tokens differ from the cached ones" if lookup.differs_at is None     # (hidden text)
                       else f"tokens differ at position {lookup.differs_at}"),
           "unrecorded": "evicted long ago, or never seen",
           }.get(lookup.reason, lookup.reason)
    return f"{hits}; block {lookup.num_hit_blocks} missed: {why}"


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step. Tokens ``start:end`` of the request get their KV computed.

    With speculative decoding a decode also carries draft tokens (the last ``len(draft_token_ids)`` of
    ``start:end``); the target accepted the first ``num_accepted`` of them and replaced the next (or, all
    accepted, added a bonus token): the request's last new token in ``StepEvent.new_token_ids``.
    """

    request_id: str
    kind: str                    # "prefill" (a whole prompt or a chunk of it, or a recompute) or "decode"
    start: int                   # num_computed_tokens before the step
    end: int                     # ... after it (drafts included; see computed_end)
    prompt_len: int
    num_cached_tokens: int       # tokens found in the prefix cache when admitted this step (else 0)
    num_output_tokens: int       # generated tokens after this step
    draft_token_ids: tuple[int, ...] = ()
    num_accepted: int = 0
    draft_pieces: tuple[str, ...] = ()   # each draft token as text, for drawing (thin clients have no tokenizer)
    target_piece: str = ""               # the target's own token after the accepted drafts, as text
    prefix_lookup: Optional[PrefixLookup] = None   # the step it was admitted: its prefix-cache hits and first miss
    # speculative_config auto_k: the drafts the automatic choice allows this request's next step (0: speculation
    # off for it) and its estimated chance that a draft is accepted; None: a fixed k (and in older traces)
    spec_k: Optional[int] = None
    spec_acceptance: Optional[float] = None

    @property
    def num_new_tokens(self) -> int:
        return self.end - self.start

    @property
    def num_rejected(self) -> int:
        return len(self.draft_token_ids) - self.num_accepted

    @property
    def computed_end(self) -> int:
        """num_computed_tokens after the step: rejected drafts' KV does not count."""
        return self.end - self.num_rejected


@dataclass(frozen=True)
class Preemption:
    request_id: str
    mode: str                    # "recompute" or "swap"
    num_blocks: int              # GPU blocks it gave up
    reason: str


@dataclass(frozen=True)
class RequestFinish:
    request_id: str
    finish_reason: str           # "stop", "length" or "abort"
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    ttft_s: Optional[float]
    e2e_s: float
    mean_itl_s: Optional[float]


@dataclass(frozen=True)
class KVChanges:
    """Every change to block ownership during the step.

    With async output processing, a step's event is emitted while the next step's forward pass runs, and its changes
    run up to that moment: they include the blocks allocated for the step in flight (the block map folded from
    the events always equals the block manager's when an event is emitted).

    Apply them in this order (``EngineView.apply`` in minipaged/event_view.py does): ``swapped_out``,
    ``freed`` (aborts and preemptions, before scheduling), ``evicted``/``uncached``, ``swapped_in``,
    ``allocated``, ``cached``, and last ``freed_on_finish`` (requests that finished after the forward pass: a
    block can be taken and let go in the same step). ``allocated[r]`` lists blocks appended to request r's
    block table (new ones and cache hits alike, in table order); ``cache_hits[r]`` says which of them were hits.
    """

    allocated: dict[str, list[int]] = field(default_factory=dict)
    cache_hits: dict[str, list[int]] = field(default_factory=dict)
    freed: dict[str, list[int]] = field(default_factory=dict)
    cached: list[int] = field(default_factory=list)          # blocks that became shareable (got a hash)
    evicted: list[int] = field(default_factory=list)         # free cached blocks whose hash was dropped
    uncached: list[int] = field(default_factory=list)        # hashes dropped by reset_prefix_cache
    swapped_out: dict[str, list[tuple[int, int]]] = field(default_factory=dict)   # (gpu block, cpu block)
    swapped_in: dict[str, list[tuple[int, int]]] = field(default_factory=dict)    # (cpu block, gpu block)
    freed_on_finish: dict[str, list[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class StepEvent:
    """What one ``Engine.step()`` did. With async output processing each ``step()`` returns the event of the step whose
    forward pass ended during it (the first returns one with nothing scheduled), one step late; its ``kv``
    also carries the blocks allocated for the step now in flight (see ``KVChanges``)."""

    step: int
    time_s: float                # seconds since the engine started, at the end of the step
    duration_s: float            # the whole step() call, wall time
    schedule_s: float            # duration_s but model_s and draft_s: scheduling, KV bookkeeping, the batch's
                                 # tensors, text and the event (async output processing: the step() call's time but its
                                 # wait for the model thread). Sampling is in model_s: see host_s for the host's all
    model_s: float               # from the forward pass's start to its tokens sampled: forward, logits stage,
                                 # sampling (verification included); with async output processing, in the model thread,
                                 # beside the previous step's host work
    budget_limit: int            # max_num_batched_tokens
    budget_used: int             # tokens computed this step
    max_num_seqs: int
    scheduled: tuple[ScheduledRequest, ...] = ()
    arrivals: tuple[RequestArrival, ...] = ()
    preempted: tuple[Preemption, ...] = ()
    swapped_in: tuple[str, ...] = ()
    finished: tuple[RequestFinish, ...] = ()
    new_token_ids: dict[str, list[int]] = field(default_factory=dict)
    new_text: dict[str, str] = field(default_factory=dict)
    kv: KVChanges = field(default_factory=KVChanges)
    num_free_blocks: int = 0
    num_cached_free_blocks: int = 0
    num_total_blocks: int = 0
    num_free_cpu_blocks: int = 0
    num_total_cpu_blocks: int = 0
    waiting: tuple[str, ...] = ()
    running: tuple[str, ...] = ()
    swapped: tuple[str, ...] = ()
    counters: dict[str, float] = field(default_factory=dict)   # cumulative totals (see Engine.stats())
    draft_s: float = 0.0         # speculative decoding: the proposer's time (a draft model's forward passes)
    # The logits stage, for requests that asked for log-probabilities / have a structured-output grammar:
    new_logprobs: dict[str, list[float]] = field(default_factory=dict)   # raw log-prob of each new token
    constrained: dict[str, tuple[int, int]] = field(default_factory=dict)  # (tokens the mask allowed, vocabulary)
    # Where the step's time went, host against forward pass (event_view.busy_seconds; the TUI's and the page's "busy"
    # gauge and lane; lessons/lesson10_gpu_waits.md). None: a trace recorded before they were kept.
    host_s: Optional[float] = None     # the host's work outside the forward pass: scheduling, the batch's tensors,
                                       # logits stage, sampling, text and the event (engine.py's _host_and_forward)
    forward_s: Optional[float] = None  # the model's forward call on the host's clock: on a CPU the time computing
                                       # it; on CUDA the time launching its kernels, which run asynchronously
    device_s: Optional[float] = None   # CUDA: the device's time for the forward pass (CUDA events, first kernel to
                                       # last: kernels/backends/forward_timer.py); None: the host computed it

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if s.kind == "prefill")

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if s.kind == "decode")

    def to_json(self) -> str:
        """``{"type": "step", **asdict(self)}`` as compact JSON (the same value): a notebook widget, a trace and a
        server's watchers serialise every step beside the engine. msgspec writes the dataclasses as they are, in
        a sixth of the time json's encoder took with a ``default`` (10 against 66 us a step of a lesson on the
        tiny model: the widget's whole cost to the engine there). Text stays UTF-8 rather than ``\\u``-escaped.
        json still writes what UTF-8 cannot carry (a lone surrogate, which a client's JSON can send in a
        prompt). A float JSON has no number for (inf, nan) is null here, where json wrote ``-Infinity``, which a
        browser's JSON.parse refuses (an event carries only the sampled tokens' log-probabilities: finite)."""
        message = {"type": "step", **_fields_of(self)}
        try:
            return _FAST_ENCODER.encode(message).decode()
        except (msgspec.EncodeError, UnicodeEncodeError):
            return _ENCODER.encode(message)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "StepEvent":
        d = {k: v for k, v in d.items() if k != "type"}
        kv = d.get("kv", {})
        kv = KVChanges(**{k: ({r: [tuple(p) for p in pairs] for r, pairs in v.items()}
                             if k in ("swapped_out", "swapped_in") else v) for k, v in kv.items()})
        return StepEvent(
            **{**d, "kv": kv,
               "scheduled": tuple(ScheduledRequest(**{**s, "draft_token_ids": tuple(s.get("draft_token_ids", ())),
                                                       "draft_pieces": tuple(s.get("draft_pieces", ())),
                                                       "prefix_lookup": _lookup(s.get("prefix_lookup"))})
                                  for s in d.get("scheduled", ())),
               "arrivals": tuple(RequestArrival.from_dict(a) for a in d.get("arrivals", ())),
               "preempted": tuple(Preemption(**p) for p in d.get("preempted", ())),
               "finished": tuple(RequestFinish(**f) for f in d.get("finished", ())),
               "swapped_in": tuple(d.get("swapped_in", ())),
               "constrained": {r: tuple(pair) for r, pair in d.get("constrained", {}).items()},
               "waiting": tuple(d.get("waiting", ())), "running": tuple(d.get("running", ())),
               "swapped": tuple(d.get("swapped", ()))})


def _lookup(d: Optional[dict[str, Any]]) -> Optional[PrefixLookup]:
    """A PrefixLookup from JSON (None: a trace recorded before lookups were explained, or no lookup was made)."""
    return None if d is None else PrefixLookup(**d)


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _fields_of(obj: Any) -> dict[str, Any]:
    """A dataclass instance's fields, one level deep (the encoder calls this again for nested ones): the same
    JSON as ``asdict`` gives, since json writes tuples as lists and ``asdict`` keeps dicts' keys as they are."""
    names = _FIELD_NAMES.get(type(obj))
    if names is None:
        if not is_dataclass(obj) or isinstance(obj, type):
            raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")
        names = _FIELD_NAMES[type(obj)] = tuple(f.name for f in fields(obj))
    return {name: getattr(obj, name) for name in names}


_ENCODER = json.JSONEncoder(separators=(",", ":"), default=_fields_of)
_FAST_ENCODER = msgspec.json.Encoder()
