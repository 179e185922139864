"""Lab 7: the scheduler's step, ``schedule()``: who runs now and how many new tokens each computes.

The student writes ``schedule(scheduler)``, the chunked-prefill policy of ``Scheduler.schedule``
(minipaged/scheduler.py) without its extras (prefix-cache hits, swap, long-prompt caps, n > 1 siblings,
speculative drafts: the lab's engine runs with them off). The lab plugs it in as the engine's scheduler's
``schedule`` (``lab_schedule`` keeps the engine's bookkeeping around it). The checks drive the engine's real
Scheduler with made-up tokens (budget, starvation, blocks of preempted requests, slots for every chunk), then
run a tiny model, whose greedy outputs must be the engine's own and whose steps stay within the budget.
"""
from __future__ import annotations

import types
from typing import Any

from minipaged.scheduler import Scheduler, SchedulerOutput

from .core import Lab, LabFailure, expect
from .harness import MadeUpEngine, expected_tokens, greedy_run, require

STUB = '''"""Lab 7: the scheduler's step. Fill in the TODOs, then run `minipaged lab check 7`.

Each step the engine asks schedule() for a SchedulerOutput: one chunk per request that runs, each computing
num_new tokens from req.num_computed_tokens on (a whole prompt, a chunk of one, a recompute, one decode token:
the same operation, vLLM v1's one loop). Rules (chunked prefill):
  1. running requests first, in order: each gets what it has left to compute (a decode: 1), within the
     token budget (scheduler.config.max_num_batched_tokens: tokens computed this step, all chunks together);
  2. then waiting requests, oldest first (scheduler.waiting[0]), while the budget lasts and fewer than
     scheduler.config.max_num_seqs run; the last one admitted is chunked to fit the budget left;
     nobody is admitted in a step that had to preempt (memory is short);
  3. every chunk needs KV slots: scheduler.kv.allocate_slots(req, num_new, start) (False: the pool is short);
     when a running request cannot get them, preempt the newest running request not yet scheduled this step
     (largest req.arrival_index) with scheduler._preempt(victim, out), and try again.
    out.chunks.append(scheduler._chunk(req, start, num_new))   records a chunk (with the block table now)
    req.num_tokens - req.num_computed_tokens                  what a request has left to compute
"""
from minipaged.request import RequestStatus
from minipaged.scheduler import SchedulerOutput


def schedule(scheduler):
    out = SchedulerOutput()
    budget = scheduler.config.max_num_batched_tokens
    scheduled = set()                      # request ids given a chunk this step
    for req in list(scheduler.running):
        if budget <= 0:
            break
        if req.status is not RequestStatus.RUNNING:
            continue                       # preempted earlier in this loop
        # TODO: how many tokens it computes; its slots (preempting the newest unscheduled running request while
        #       allocate_slots says no; if that is req itself, it does not run); its chunk; the budget.
        raise NotImplementedError("schedule: running requests")
    if not out.preempted:
        # TODO: admit waiting requests (rule 2): take it out of the queue, mark it RUNNING, append it to
        #       scheduler.running, record its chunk (it starts at 0).
        raise NotImplementedError("schedule: waiting requests")
    return out
'''

LAB_OPTIONS = {"enable_prefix_caching": False, "preemption_mode": "recompute", "long_prefill_token_threshold": 0,
               "enable_chunked_prefill": True, "policy": "continuous"}


def lab_schedule(fn: Any, scheduler: Scheduler) -> SchedulerOutput:
    """``Scheduler.schedule`` with the step's plan made by ``fn``: the bookkeeping around it stays the engine's."""
    out = fn(scheduler)
    if not isinstance(out, SchedulerOutput):
        raise LabFailure(f"schedule() returned {type(out).__name__}; return the SchedulerOutput you filled.")
    return scheduler._seal(out)


def use_in(scheduler: Scheduler, fn: Any) -> None:
    scheduler.schedule = types.MethodType(lambda self: lab_schedule(fn, self), scheduler)


def install(engine: Any, fn: Any) -> None:
    """The engine's scheduler plans every step with the student's function."""
    use_in(engine.scheduler, fn)


def made_up_run(fn: Any, prompt_lens: list[int], max_tokens: int, *, arrive_at: dict[int, int] | None = None,
                inspect: Any = None, **engine_options: Any) -> MadeUpEngine:
    """Drive the engine's Scheduler with ``fn`` as its step; request i arrives before step ``arrive_at[i]``
    (default 0). ``inspect(engine, out, before)`` sees each step's plan and the running decodes before it."""
    engine = MadeUpEngine(**engine_options)
    use_in(engine.scheduler, fn)
    arrive_at = arrive_at or {}
    pending = sorted(range(len(prompt_lens)), key=lambda i: arrive_at.get(i, 0))
    while pending or engine.scheduler.has_unfinished():
        while pending and arrive_at.get(pending[0], 0) <= engine.steps:
            engine.add(prompt_lens[pending.pop(0)], max_tokens)
        if engine.steps >= 2000:
            raise LabFailure("after 2000 steps requests are still unfinished: some request never gets scheduled.")
        decoding = [r for r in engine.scheduler.running if r.num_computed_tokens == r.num_tokens - 1
                    and r.num_computed_tokens >= r.num_prompt_tokens]
        engine.step(None if inspect is None else lambda out: inspect(engine, out, decoding))
    return engine


def budget_never_exceeded(fn: Any) -> None:
    """each step computes at most max_num_batched_tokens tokens; the last prefill is chunked to fit"""
    budget = 16

    def inspect(engine: MadeUpEngine, out: SchedulerOutput, decoding: list) -> None:
        used = out.num_batched_tokens
        if used > budget:
            big = max(out.chunks, key=lambda c: c.num_new_tokens)
            raise LabFailure(f"step {engine.steps} computes {used} tokens with a budget of {budget}: request "
                             f"{big.request.request_id}'s chunk alone is {big.num_new_tokens}. A prefill that "
                             f"overruns the budget makes the step as long as the whole prompt, and every decode in "
                             f"it waits that long. Give the last prefill only the budget left (chunk it): the rest "
                             f"comes in the next steps.")
        expect(len(engine.scheduler.running) <= engine.scheduler.config.max_num_seqs,
               f"step {engine.steps} runs {len(engine.scheduler.running)} requests; max_num_seqs is "
               f"{engine.scheduler.config.max_num_seqs}.")

    made_up_run(fn, [40, 5, 23], 4, inspect=inspect, num_blocks=64, max_num_batched_tokens=budget, max_num_seqs=2)


def decodes_keep_going(fn: Any) -> None:
    """a long prompt arriving does not stop the running requests' decodes"""

    def inspect(engine: MadeUpEngine, out: SchedulerOutput, decoding: list) -> None:
        granted = {c.request.request_id for c in out.chunks}
        gone = {p.request.request_id for p in out.preempted}
        starved = [r.request_id for r in decoding if r.request_id not in granted | gone]
        if starved:
            prefills = [f"{c.request.request_id} ({c.num_new_tokens} tokens)" for c in out.chunks
                        if c.kind == "prefill"]
            raise LabFailure(f"step {engine.steps}: running request(s) {', '.join(starved)} were decoding and got no "
                             f"token, while the step prefilled {', '.join(prefills) or 'nothing'}. Decodes starved "
                             f"by a long prompt: every running user sees their stream stop while someone else's "
                             f"prompt is read. Running requests come first; waiting prompts get what is left of "
                             f"the budget.")

    # two short requests decode; a 120-token prompt arrives at step 3 and takes many steps to prefill
    made_up_run(fn, [4, 6, 120], 12, arrive_at={2: 3}, inspect=inspect, num_blocks=64, max_num_batched_tokens=16)


def preempted_requests_hold_no_blocks(fn: Any) -> None:
    """in an oversubscribed pool, a preempted (waiting) request holds no blocks, and every block returns"""

    def inspect(engine: MadeUpEngine, out: SchedulerOutput, decoding: list) -> None:
        for req in engine.scheduler.waiting:
            held = engine.kv.blocks_of(req.request_id)
            if held:
                raise LabFailure(f"step {engine.steps}: request {req.request_id} waits (preempted) but holds "
                                 f"{len(held)} blocks. A preempted request that keeps its blocks leaks them: the "
                                 f"pool was empty, that is why it was preempted, and those blocks never return. "
                                 f"Preempt with scheduler._preempt(victim, out), which frees them.")
        for chunk in out.chunks:
            have = len(engine.kv.blocks_of(chunk.request.request_id)) * engine.kv.block_size
            expect(have >= chunk.end, f"step {engine.steps}: request {chunk.request.request_id}'s chunk writes "
                                      f"tokens up to {chunk.end} but it has slots for {have}: allocate_slots "
                                      f"before recording a chunk (the model would write KV into someone else's "
                                      f"block).")

    engine = made_up_run(fn, [6, 9, 5, 12, 7, 8], 14, inspect=inspect, num_blocks=10, max_num_batched_tokens=32)
    expect(engine.scheduler.num_preemptions["recompute"] > 0,
           "the oversubscribed workload never preempted anyone: when allocate_slots says no, preempt the newest "
           "running request not yet scheduled, and try again.")
    expect(engine.kv.num_free_blocks == engine.num_blocks,
           f"every request finished, yet {engine.num_blocks - engine.kv.num_free_blocks} blocks are not free: a leak.")
    for req in engine.requests:
        want = expected_tokens(req.num_prompt_tokens, req.arrival_index, req.params.max_tokens)
        expect(list(req.output_token_ids) == want,
               f"request {req.request_id} ended with tokens that differ from a run without preemption: does each "
               f"chunk start at req.num_computed_tokens?")


def outputs_match_the_engines_own(fn: Any) -> None:
    """on a tiny model: greedy outputs equal the engine's own scheduler's, and every step keeps to the budget"""
    require(fn, budget_never_exceeded, decodes_keep_going, preempted_requests_hold_no_blocks)
    prompts = [[(5 * i + t) % 250 for t in range(4 + 7 * i)] for i in range(6)]
    options = {**LAB_OPTIONS, "num_blocks": 14, "max_num_batched_tokens": 16, "attention_backend": "torch"}
    _, want, _ = greedy_run(None, prompts, 12, **options)
    _, got, events = greedy_run(lambda e: install(e, fn), prompts, 12, **options)
    over = [ev for ev in events if ev.budget_used > ev.budget_limit]
    expect(not over, f"step {over[0].step if over else 0} computed {over[0].budget_used if over else 0} tokens with "
                     f"a budget of {over[0].budget_limit if over else 0}: a prefill overruns the budget.")
    for i, (g, w) in enumerate(zip(got, want)):
        expect(g == w, f"request {i}'s greedy tokens are {g} with your schedule(), {w} with the engine's own.")


def engine_schedule(scheduler: Scheduler) -> SchedulerOutput:
    """The engine's own chunked-prefill step (``Scheduler.schedule`` with the lab's options), as the lab's function."""
    out = SchedulerOutput()
    budget = scheduler._schedule_running(out, scheduler.config.max_num_batched_tokens)
    if not out.preempted:
        scheduler._admit_waiting(out, budget)
    return out


def reference() -> Any:
    return engine_schedule


LAB = Lab(7, "lab7_schedule", "The scheduler's step: schedule()", "schedule", STUB, reference,
          (budget_never_exceeded, decodes_keep_going, preempted_requests_hold_no_blocks,
           outputs_match_the_engines_own),
          reference_options=LAB_OPTIONS, install=install)
