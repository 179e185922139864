"""The scheduler: each step, which requests run and how many new tokens each computes.

One loop serves every case (vLLM v1's design): a request is granted ``num_new_tokens`` so that its
``num_computed_tokens`` catches up with its known tokens. A whole prompt, a chunk of one, a recompute after
preemption and a single decode token are all the same operation with different sizes.

Policies
  * chunked prefill on (default): first every running decode, then running prefills, then swapped
    requests coming back, then new requests in arrival order; the last prefill that does not fit the token
    budget is chunked. Decodes are never starved by long prompts.
  * chunked prefill off (vLLM's old default): prefill-first. A step runs either whole prompts or decodes,
    never both; a waiting prompt delays every running decode.
  * static (teaching baseline): a batch is formed, and nothing new joins until its last request ends.
  * In every policy, swapped-out requests come back before any new request is admitted.
  * Which waiting request is admitted next, and which running request is preempted, are policies
    (``minipaged.policies``): ``--scheduling-policy`` (fcfs, priority ...) and ``--preemption-victim`` (newest
    ...). A policy that raises fails the request it was deciding about; the others are served.

Fair share by client (``fair_share``): ``minipaged.policies.client_share`` shares admission, preemption, the
pool and a step's work between clients first, then requests (its docstring tells how).

Long prompts share the step (chunked prefill; vLLM's ``long_prefill_token_threshold``,
``max_long_partial_prefills``, ``max_num_partial_prefills``)
  * A prompt with more than ``long_prefill_token_threshold`` tokens left to compute (uncached) is *long*: it
    gets at most that many tokens per step, so the rest of the budget serves others, and a step stays short
    enough for everyone's decodes to keep coming.
  * At most ``max_long_partial_prefills`` long prompts prefill at once, and at most ``max_num_partial_prefills``
    prompts of any length are mid-prefill (a prompt whose chunk this step does not finish it). A waiting
    request that would pass a limit waits, and the requests behind it that fit are admitted first: a 16-token
    question does not queue behind a 7,000-token prompt. The ones that waited keep their place in the order.
  * The n samples of one request share their prompt through the prefix cache. While one sample is still
    prefilling the prompt, its siblings wait: each step's chunk publishes its blocks, so once the first sample
    has been granted the whole prompt the others find all of it cached and compute only the last token,
    instead of prefilling the same long prompt n times side by side. (vLLM fans n out into independent child
    requests and relies on its prefix cache alone; with a capped chunk that would let the children race the
    first sample through the same tokens.)

Token accounting (vLLM v1's ``update_from_output``)
  * After the forward pass, ``update_from_output`` is the one place that advances ``num_computed_tokens``,
    appends sampled tokens and finishes requests whose token says stop (EOS, a stop token id, max_tokens,
    max_model_len).
  * A request ends one way, ``finish_requests``, whoever ends it: a token here, the front end (a stop string
    found in the text, an abort), a grammar or a policy that failed. Its blocks are freed at once, and its id
    goes out with the next ``SchedulerOutput`` (``finished_req_ids``), so that whoever keeps per-request state
    for the forward pass (sampler, logits stage, speculator) drops it there, as vLLM v1's workers do.

Speculative decoding
  * A decode that has draft tokens (``Request.spec_token_ids``, guessed after the last step) schedules them
    as ordinary extra tokens: [last token, d_0 .. d_{k-1}] share the token budget with prefill chunks and
    are trimmed when it is short; slots are allocated for them (a draft model also gets k "lookahead" slots
    to write its own guesses' KV, as vLLM's ``num_lookahead_tokens``). Drafts are not the request's tokens,
    so they are never hashed into the prefix cache.
  * After verification ``update_from_output`` appends the accepted drafts and the target's own token, and
    rolls ``num_computed_tokens`` back by the rejected count: those slots stay allocated, and the next
    step's tokens overwrite them. A preempted request drops its drafts.

Memory
  * Admission counts only blocks a request needs beyond its cached prefix, and the budget is charged only
    for tokens that are not cached.
  * When a running request cannot get a block, a running request that has not yet been scheduled this step
    is preempted (by default the most recently arrived, vLLM's rule): ``recompute`` frees its blocks and
    requeues it at the head of the waiting queue (its generated tokens kept); ``swap`` copies its blocks to
    the CPU pool first.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

from .request import Request, RequestStatus

if TYPE_CHECKING:                      # the builder hands the parts in: the scheduler imports none of them
    from .config import EngineConfig
    from .kv_cache_manager import KVCacheManager
    from .policies import RequestOrder, VictimPolicy
    from .policies.client_share import ClientShare, StepShare
    from .swap import CpuBlockPool

logger = logging.getLogger("minipaged.scheduler")
MAX_SKIPPED_PER_STEP = 256   # waiting requests one step looks past (long or siblings' prompt not ready) at most


@dataclass
class ScheduledChunk:
    """One request's work this step: compute KV for tokens ``start : start + num_new_tokens``.

    It carries everything the model runner needs, so the runner never asks the block manager: the block
    table as it stands for this step, and whether this chunk reaches the end of the request's known tokens
    (then its last row's logits are sampled; a chunk in the middle of a prompt only fills the cache).
    """

    request: Request
    start: int
    num_new_tokens: int
    block_table: tuple[int, ...] = ()
    num_cached_tokens: int = 0      # prefix-cache hit at admission this step (tokens)
    cached_prefix_end: int = 0      # positions below this sit in cache-hit blocks: never rewrite their KV
    samples: bool = False           # True when every known token has KV after this chunk
    spec_token_ids: tuple[int, ...] = ()   # draft tokens, the chunk's last tokens (speculative decoding)
    admitted: bool = False          # admitted this step after a prefix-cache lookup (observers explain it)

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def num_known_tokens(self) -> int:
        """Scheduled tokens that are the request's own (the rest are drafts to verify)."""
        return self.num_new_tokens - len(self.spec_token_ids)

    @property
    def kind(self) -> str:
        """'decode' for one token past the prompt (plus any drafts), else 'prefill' (a prompt, a chunk, a recompute)."""
        return "decode" if self.num_known_tokens == 1 and self.start >= self.request.num_prompt_tokens else "prefill"


@dataclass
class PreemptionRecord:
    request: Request
    mode: str
    num_blocks: int


@dataclass
class StepUpdate:
    """What a step changed in the requests: each one's new tokens (in the order of the chunks) and the ones
    that finished (their blocks already freed)."""

    new_token_ids: dict[str, list[int]] = field(default_factory=dict)
    finished: list[Request] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[PreemptionRecord] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)   # (gpu block, cpu block) copies
    swap_in: list[tuple[int, int]] = field(default_factory=list)    # (cpu block, gpu block) copies
    swapped_in: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)    # aborted because a policy raised deciding about them
    finished_req_ids: set[str] = field(default_factory=set)   # ended since the last schedule: drop their state

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, cpu_pool: CpuBlockPool,
                 eos_token_ids: Sequence[int] = (), num_lookahead_tokens: int = 0, *, order: RequestOrder,
                 victim_policy: VictimPolicy, client_share: Optional[ClientShare] = None) -> None:
        self.config = config
        self.num_lookahead_tokens = num_lookahead_tokens   # slots a draft model writes its guesses into
        self.kv = kv
        self.cpu_pool = cpu_pool
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.num_preemptions = {"recompute": 0, "swap": 0}
        self.num_finished = 0
        self.finished_req_ids: set[str] = set()      # ended since the last schedule (SchedulerOutput carries them)
        self.order = order                           # which waiting request is admitted next (--scheduling-policy)
        self.victim_policy = victim_policy           # which running request is preempted (--preemption-victim)
        self.client_share = client_share             # fair share by client (--fair-share); None: by request only
        self._share: Optional[StepShare] = None      # its view of this step

    # ------------------------------------------------------------------ queues
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish_requests(self, reqs: Sequence[Request], status: RequestStatus,
                        stop_reason: Optional[str | int] = None) -> list[Request]:
        """The one way a request ends (a token, a stop string, an abort, a failure): out of whichever queue
        holds it, its memory freed at once (continuous batching: the next step can give the blocks to someone
        else), its id kept for the next ``SchedulerOutput``. Requests already finished are left as they are;
        returns the ones this call ended. Each queue is filtered once (the n samples of an aborted request),
        never scanned once per request."""
        reqs = [r for r in reqs if not r.is_finished]
        gone = {id(r) for r in reqs}
        states = {r.status for r in reqs}
        if RequestStatus.WAITING in states:             # rebuilt as the same kind of queue, order kept
            self.waiting = type(self.waiting)(r for r in self.waiting if id(r) not in gone)
        if RequestStatus.RUNNING in states:
            self.running = type(self.running)(r for r in self.running if id(r) not in gone)
        if RequestStatus.SWAPPED in states:
            self.swapped = [r for r in self.swapped if id(r) not in gone]
        for req in reqs:
            if req.status is RequestStatus.SWAPPED:
                self.cpu_pool.release(req.request_id)
            req.status = status
            if stop_reason is not None:
                req.stop_reason = stop_reason
            self.kv.free(req)
            self.finished_req_ids.add(req.request_id)
        self.num_finished += len(reqs)
        return reqs

    def _chunk(self, req: Request, start: int, num_new: int, num_cached: int = 0,
               cached_prefix_end: int = 0, spec_token_ids: Sequence[int] = (), admitted: bool = False
               ) -> ScheduledChunk:
        """The runner's share of a grant: the tokens, the block table now, and whether it samples."""
        return ScheduledChunk(req, start, num_new, tuple(self.kv.blocks_of(req.request_id)), num_cached,
                              cached_prefix_end, samples=start + num_new - len(spec_token_ids) == req.num_tokens,
                              spec_token_ids=tuple(spec_token_ids) if spec_token_ids else (),
                              admitted=admitted)

    def _allocate(self, req: Request, num_new: int, start: Optional[int] = None,
                  cached_blocks: Sequence[int] = ()) -> bool:
        """Slots for the scheduled tokens, plus a draft model's lookahead slots where the request can use them
        (never past max_model_len or its last token); a client over its fair share leaves newcomers' blocks."""
        start, lookahead = req.num_computed_tokens if start is None else start, 0
        if self.num_lookahead_tokens:
            last_possible = min(self.config.max_model_len, req.num_prompt_tokens + req.params.max_tokens)
            lookahead = max(0, min(self.num_lookahead_tokens, last_possible - (start + num_new)))
        return self.kv.allocate_slots(req, num_new, start, cached_blocks, num_lookahead_tokens=lookahead,
                                      num_reserved=self._fair.reserved_against(req) if self._fair else 0)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        assert budget is not None
        if self.client_share is not None:
            self._share = self.client_share.begin_step((self.running, self.waiting, self.swapped), (
                self.config.long_prefill_token_threshold or 0) if self._shares_steps else 0)
            if (fair := self._fair) and self.config.policy == "continuous":      # a newcomer takes its share back
                for heaviest in fair.share_back(self.waiting, self.running, self.kv, self.order.first, self._chunk_cap):
                    if (victim := self._choose_victim(set(), heaviest[0], out, heaviest)) is None:
                        break                              # the policy raised: one of them failed instead
                    self._preempt(victim, out)
        if self.config.policy == "static":
            # The batch is running + swapped; it takes no newcomer until all of it has finished.
            budget = self._schedule_running(out, budget)
            if not out.preempted:
                budget = self._swap_in(out, budget)
                if not self.running and not self.swapped:
                    self._admit_waiting(out, budget)
        elif self.config.enable_chunked_prefill:
            budget = self._schedule_running(out, budget)
            if not out.preempted:                          # memory is short this step: admit nobody ...
                budget = self._swap_in(out, budget)
                if not self.swapped:                       # swapped requests come back before newcomers
                    self._admit_waiting(out, budget)
            elif fair := self._fair:                       # ... but a client under its share (fair share)
                self._admit_waiting(out, budget, fair.kept_for)
        else:
            # Prefill-first: new prompts get the step to themselves; decodes wait for a step without them.
            if not self.swapped:
                self._admit_waiting(out, budget)
            if not out.chunks:
                budget = self._schedule_running(out, budget)
                if not out.preempted:
                    self._swap_in(out, budget)
        return self._seal(out)

    def _seal(self, out: SchedulerOutput) -> SchedulerOutput:
        """What every step's plan carries whoever made it (lab 7 plans with a student's function): when each
        request was first scheduled, and the ids that ended since the last step."""
        now = time.perf_counter()
        for chunk in out.chunks:
            if chunk.request.first_scheduled_time is None:
                chunk.request.first_scheduled_time = now
        out.finished_req_ids, self.finished_req_ids = self.finished_req_ids, set()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # Decodes first, then running prefills (chunks of long prompts, recomputes); stable sort keeps FCFS.
        scheduled_ids = {c.request.request_id for c in out.chunks}
        fair = self._fair                 # the lightest clients first (the heaviest can be preempted), decodes in turns
        for req in fair.running_order(self.running, self.kv.blocks_of) if fair else \
                sorted(self.running, key=lambda r: r.is_prefill):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING or req.request_id in scheduled_ids:
                continue
            # A decode's drafts ride along as extra tokens, as many as the budget leaves room for.
            num_known = req.num_tokens - req.num_computed_tokens
            num_new = min(self._chunk_cap(num_known) + len(req.spec_token_ids), budget)
            if num_known > 1 and self._share:          # a prefill: within the step's allowance (fair share)
                num_new = self._share.within(num_new, req.num_computed_tokens)
                if num_new < 1:
                    continue
            while not self._allocate(req, num_new):
                victim = self._choose_victim(scheduled_ids, req, out)
                if victim is None:
                    break                                  # the policy raised: req failed instead
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                drafts = ()
                if req.spec_token_ids:                     # (a plain decode has none: nothing to write)
                    drafts, req.spec_token_ids = req.spec_token_ids[:max(0, num_new - num_known)], []
                out.chunks.append(self._chunk(req, req.num_computed_tokens, num_new, spec_token_ids=drafts))
                scheduled_ids.add(req.request_id)
                budget -= num_new
                if num_known > 1 and self._share:
                    self._share.charge(num_new, req.num_computed_tokens)
        return budget

    @property
    def _fair(self) -> Optional[StepShare]:
        """The step's fair share while two or more clients have requests (alone, one is scheduled as without)."""
        return self._share if self._share is not None and self._share.contended else None

    def _choose_victim(self, scheduled_ids: set[str], needs_room: Request, out: SchedulerOutput,
                       candidates: Optional[list[Request]] = None) -> Optional[Request]:
        """The victim policy's choice among ``candidates`` or else the running requests not yet scheduled this step
        (``needs_room`` among them). If the policy raises or answers something else, ``needs_room`` fails."""
        if candidates is None:
            candidates = [r for r in self.running if r.request_id not in scheduled_ids]
            if fair := self._fair:                     # from the client holding the most blocks
                candidates = fair.victims(candidates, needs_room, self.running, self.kv.blocks_of, self.kv.num_blocks)
        try:
            victim = self.victim_policy.choose(candidates, lambda r: len(self.kv.blocks_of(r.request_id)))
            if victim not in candidates:
                raise ValueError(f"it chose {victim!r}, which is not one of the candidates")
            return victim
        except Exception as e:
            self._fail(needs_room, "preemption_victim", self.victim_policy, e, out)
            return None

    def _fail(self, req: Request, option: str, policy: object, error: Exception, out: SchedulerOutput) -> None:
        """A policy raised while deciding about ``req``: abort it (its blocks freed) and serve the others."""
        logger.error("%s %s raised %s: %s; request %s is aborted, the others go on.", option,
                     type(policy).__name__, type(error).__name__, error, req.request_id)
        req.error = req.error or (f"the {option} policy {type(policy).__name__} raised {type(error).__name__}: "
                                  f"{error}")
        self.finish_requests([req], RequestStatus.FINISHED_ABORTED)
        out.failed.append(req)

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        num_blocks = len(self.kv.blocks_of(victim.request_id))
        self.running.remove(victim)
        victim.num_preemptions += 1
        victim.spec_token_ids = []                 # guesses for a step that will not come
        mode = self.config.preemption_mode
        mapping = self.kv.swap_out(victim, self.cpu_pool) if mode == "swap" else None
        if mapping is not None:
            victim.status = RequestStatus.SWAPPED
            self.swapped.append(victim)
            self.swapped.sort(key=lambda r: r.arrival_index)
            out.swap_out.extend(mapping)
        else:
            if mode == "swap":
                logger.info("CPU swap pool is full; request %s falls back to recompute.", victim.request_id)
            mode = "recompute"
            self.kv.free(victim, forget_hashes=False)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.WAITING
            self.waiting.appendleft(victim)
        self.num_preemptions[mode] += 1
        out.preempted.append(PreemptionRecord(victim, mode, num_blocks))
        total = sum(self.num_preemptions.values())
        logger.warning(
            "Request %s is preempted by PreemptionMode.%s because there is not enough KV cache space. "
            "This can affect the end-to-end performance. Increase num_blocks (or kv_cache_memory, or "
            "gpu_memory_utilization on CUDA) to provide more KV cache memory, or decrease max_num_seqs or "
            "max_num_batched_tokens. total_cumulative_preemption_cnt=%d",
            victim.request_id, mode.upper(), total)

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        """Bring swapped requests back (oldest first) before admitting anything new."""
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.swapped[0]
            if not self.kv.can_swap_in(req, self.cpu_pool, self._fair.reserved_against(req) if self._fair else 0):
                break
            self.swapped.pop(0)
            out.swap_in.extend(self.kv.swap_in(req, self.cpu_pool))
            out.swapped_in.append(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_known = req.num_tokens - req.num_computed_tokens
            num_new = min(num_known, budget, self._chunk_cap(num_known))
            if num_known > 1 and self._share:
                num_new = self._share.within(num_new, req.num_computed_tokens)
            if num_new > 0 and self._allocate(req, num_new):
                out.chunks.append(self._chunk(req, req.num_computed_tokens, num_new))
                budget -= num_new
                if num_known > 1 and self._share:
                    self._share.charge(num_new, req.num_computed_tokens)
        return budget

    @property
    def _shares_steps(self) -> bool:
        """Long prompts are capped and counted only where prompts are chunked (not prefill-first, not static)."""
        return self.config.enable_chunked_prefill and self.config.policy == "continuous"

    def _chunk_cap(self, num_left: int) -> int:
        """The most tokens a prefill with ``num_left`` tokens to compute may take this step: the threshold when
        it is long, else no cap of its own (only the budget's)."""
        threshold = self.config.long_prefill_token_threshold or 0
        return threshold if self._shares_steps and 0 < threshold < num_left else num_left

    def _partial_prefills(self, out: SchedulerOutput) -> tuple[int, int, set[str]]:
        """Before admissions: how many running prompts are long and how many stay mid-prefill after this step,
        and the parents (n > 1) whose prompt is not yet granted in full to one of their samples."""
        granted = {c.request.request_id: c.end for c in out.chunks}
        num_long = num_partial = 0
        parents: set[str] = set()
        for req in self.running:
            num_left = req.num_tokens - req.num_computed_tokens
            if num_left <= 1:
                continue                                   # a decode
            end = granted.get(req.request_id, req.num_computed_tokens)
            num_long += self._chunk_cap(num_left) < num_left
            num_partial += end < req.num_tokens
            if req.params.n > 1 and end < req.num_prompt_tokens:
                parents.add(req.parent_id)
        return num_long, num_partial, parents

    def _admit_waiting(self, out: SchedulerOutput, budget: int, clients: Optional[set[str]] = None) -> int:
        """Admit new requests (``clients``' only, if given) in the scheduling policy's order while the budget,
        max_num_seqs and the pool allow. A request that would pass a limit on long or partial prefills, or whose
        sibling is still prefilling their prompt, waits without holding up those behind it (keeping its place)."""
        chunked = self.config.enable_chunked_prefill
        num_long, num_partial, prefilling_parents = self._partial_prefills(out)
        max_partial = self.config.max_num_partial_prefills if self._shares_steps else None
        skipped: list[Request] = []
        turns: Optional[Iterator[Request]] = None        # fair share: the clients' turns
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs \
                and len(skipped) < MAX_SKIPPED_PER_STEP:
            try:
                if (fair := self._fair) is None:
                    req = self.order.first(self.waiting)
                elif (req := next(turns := turns or fair.turns(self.waiting, self.order.first, clients), None)) \
                        is None:
                    break                                  # every waiting request had its turn
                if req not in self.waiting:
                    raise ValueError(f"it chose {req!r}, which is not waiting")
            except Exception as e:
                turns = None                               # made again without the requests that failed
                for culprit in self._keys_that_raise() or [self.waiting[0]]:
                    self._fail(culprit, "scheduling_policy", self.order, e, out)
                continue
            # Prompt log-probabilities need every prompt row's logits: a cached prefix has none (as in vLLM).
            looked = self.kv.enable_caching and req.params.prompt_logprobs is None
            if looked and req.params.n > 1 and req.parent_id in prefilling_parents:
                self._take_waiting(req)                    # its sibling's blocks will be its cache hits
                skipped.append(req)
                continue
            cached_blocks, num_cached = self.kv.find_cached_prefix(req) if looked else ([], 0)
            num_uncached = req.num_tokens - num_cached     # the budget pays only for uncached tokens
            num_new = self._chunk_cap(num_uncached)
            is_long = num_new < num_uncached
            if num_new > budget:
                if not chunked:
                    break                                  # whole prompts only: wait for a later step
                num_new = budget
            if self._share and (num_new := self._share.within(num_new, num_cached)) < 1:
                break                                      # the step's allowance is spent (fair share)
            if (is_long and num_long >= self.config.max_long_partial_prefills) or \
                    (num_new < num_uncached and max_partial is not None and num_partial >= max_partial):
                self._take_waiting(req)                    # shorter ones behind it go first
                skipped.append(req)
                continue
            if not self._allocate(req, num_new, start=num_cached, cached_blocks=cached_blocks):
                if not (self._fair and self._fair.reserved_against(req)):
                    break                                  # nobody jumps the queue the policy set ...
                self._take_waiting(req)                    # ... but the room kept for another client's newcomer
                skipped.append(req)
                continue
            self._take_waiting(req)
            if self._share:
                self._share.admitted(req, num_new, num_cached)
            num_long += is_long
            num_partial += num_new < num_uncached
            if req.params.n > 1 and num_cached + num_new < req.num_prompt_tokens:
                prefilling_parents.add(req.parent_id)
            self.kv.record_prefix_query(req.num_tokens, num_cached)
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.chunks.append(self._chunk(req, num_cached, num_new, num_cached,
                                          cached_prefix_end=len(cached_blocks) * self.kv.block_size,
                                          admitted=looked))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))        # back where they were: first in the order still
        return budget

    def _keys_that_raise(self) -> list[Request]:
        """After the order policy raised: the waiting requests whose key raises (the ones it cannot order)."""
        culprits = []
        for req in self.waiting:
            try:
                self.order.key(req)
            except Exception:
                culprits.append(req)
        return culprits

    def _take_waiting(self, req: Request) -> None:
        """Out of the waiting queue: O(1) for the head (FCFS always admits it), a scan otherwise."""
        if self.waiting[0] is req:
            self.waiting.popleft()
        else:
            self.waiting.remove(req)

    # ------------------------------------------------------------------ after the forward pass
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, Optional[list[int]]]) -> StepUpdate:
        """Account for a finished forward pass; returns each request's new tokens and the requests that finished.

        Every scheduled chunk's KV now exists, so ``num_computed_tokens`` moves to its end. A request whose
        chunk reached the end of its known tokens got new tokens: one sampled token, or with speculative
        decoding the accepted drafts plus the target's own token (``None``: its sampling failed, and it
        alone is aborted). Drafts the target rejected hold KV for tokens that are not the request's, so
        ``num_computed_tokens`` rolls back over them; their slots stay allocated and get overwritten.
        Each token is appended and checked against the stop conditions that a token decides (EOS, stop ids,
        lengths); tokens after a stop are dropped. Stop *strings* need text: the front end finds them
        afterwards and ends the request through ``finish_requests``. A request that finished while the forward
        pass ran (async output processing: a stop string found in the previous step's text, an abort) is skipped.
        """
        self.kv.mark_forward_done()
        update = StepUpdate()
        for chunk in out.chunks:
            req = chunk.request
            if req.is_finished:
                continue      # a stop string or an abort ended it while this step ran (async output processing):
                              # its token is dropped as if never generated (its blocks are freed already)
            req.num_computed_tokens = chunk.end
            if req.request_id not in sampled:
                continue                                   # a chunk in the middle of a prompt: nothing sampled
            tokens = sampled[req.request_id]
            status: Optional[RequestStatus] = RequestStatus.FINISHED_ABORTED if tokens is None else None
            stop_reason = None
            if tokens and not chunk.spec_token_ids:        # one sampled token (no drafts): nothing to roll back
                update.new_token_ids[req.request_id] = tokens
                status, stop_reason = self._append_token(req, tokens[0])
            elif tokens:
                num_rejected = len(chunk.spec_token_ids) - (len(tokens) - 1)
                req.num_computed_tokens -= num_rejected
                appended = update.new_token_ids[req.request_id] = []
                for token in tokens:
                    status, stop_reason = self._append_token(req, token)
                    appended.append(token)
                    if status is not None:
                        break
            if status is not None:
                update.finished.extend(self.finish_requests([req], status, stop_reason))
        return update

    def _append_token(self, req: Request, token: int) -> tuple[Optional[RequestStatus], Optional[int]]:
        """Append a sampled token; the finished status (and the stop token) if it ends the request."""
        req.output_token_ids.append(token)
        params = req.params
        if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
        if len(req.output_token_ids) >= params.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None
