"""Lab 6: preemption by recompute, what the scheduler does when the KV pool runs dry.

The student writes ``preempt(scheduler, victim)``: the part of ``Scheduler._preempt`` (minipaged/scheduler.py)
that moves the victim, for ``preemption_mode="recompute"``. The lab plugs it in where the engine's own runs
(``lab_preempt`` keeps the engine's bookkeeping: counts, the step's record, dropped drafts). The checks watch
the first preemption of an oversubscribed pool (the engine's real Scheduler, tokens made up), then run whole
workloads: made up, then on a tiny model, whose greedy outputs must be the engine's own.
"""
from __future__ import annotations

import types
from typing import Any

from minipaged.request import Request, RequestStatus
from minipaged.scheduler import PreemptionRecord, Scheduler, SchedulerOutput

from .core import Lab, LabFailure, expect
from .harness import MadeUpEngine, expected_tokens, greedy_run, require

STUB = '''"""Lab 6: preemption by recompute. Fill in the TODOs, then run `minipaged lab check 6`.

A running request needs a new KV block and the pool has none. The scheduler picks a victim among the running
requests (by default the newest: it has the least work to lose) and calls preempt(scheduler, victim).
Recompute (vLLM's default): drop the victim's KV and requeue it; when it is admitted again, its prompt *and*
the tokens it already generated are prefilled again in one go, and it goes on generating where it stopped.
The scheduler counts the preemption and records it for the step; you move the request.
    scheduler.running   list of running requests        scheduler.waiting   deque: the next admitted is [0]
    scheduler.kv        the KV cache manager: kv.free(request, forget_hashes=...) gives a request's blocks back
    victim.output_token_ids   the tokens it generated so far; victim.num_computed_tokens: tokens whose KV exists
"""
from minipaged.request import RequestStatus


def preempt(scheduler, victim):
    # TODO: the victim stops running.
    raise NotImplementedError("preempt: stop running")
    # TODO: its KV blocks go back to the pool (forget_hashes=False keeps its full blocks in the prefix cache:
    #       when it comes back, they may still be there to hit).
    raise NotImplementedError("preempt: give the blocks back")
    # TODO: its KV is gone: how many of its tokens are computed now? What is its status?
    raise NotImplementedError("preempt: what it has left")
    # TODO: requeue it. Where in scheduler.waiting?
    raise NotImplementedError("preempt: requeue")
'''


def lab_preempt(fn: Any, scheduler: Scheduler, victim: Request, out: SchedulerOutput) -> None:
    """``Scheduler._preempt`` in recompute mode, the victim's moves done by ``fn``: what the engine records
    around them stays the engine's."""
    num_blocks = len(scheduler.kv.blocks_of(victim.request_id))
    victim.num_preemptions += 1
    victim.spec_token_ids = []                 # guesses for a step that will not come
    fn(scheduler, victim)
    if victim in scheduler.running:
        raise LabFailure(f"request {victim.request_id} is still in scheduler.running after preempt(): the scheduler "
                         f"would pick it again and again. Remove it from the running list.")
    scheduler.num_preemptions["recompute"] += 1
    out.preempted.append(PreemptionRecord(victim, "recompute", num_blocks))


def install(engine: Any, fn: Any) -> None:
    """The engine's scheduler preempts through the student's function (recompute mode)."""
    use_in(engine.scheduler, fn)


def use_in(scheduler: Scheduler, fn: Any) -> None:
    scheduler._preempt = types.MethodType(lambda self, victim, out: lab_preempt(fn, self, victim, out), scheduler)


class FirstPreemption:
    """The state of the victim and the pool just before and just after the first preemption of a run that
    oversubscribes a pool of 8 blocks (three running requests growing to 5 blocks each, two waiting)."""

    def __init__(self, fn: Any) -> None:
        # three seats: when the first one is preempted, two newer requests are still waiting for a seat
        self.engine = MadeUpEngine(num_blocks=8, max_num_batched_tokens=64, max_num_seqs=3)
        for _ in range(5):
            self.engine.add(prompt_len=6, max_tokens=12)
        self.seen: list[dict] = []
        scheduler = self.engine.scheduler

        def watched(victim: Request, scheduler: Scheduler = scheduler) -> dict:
            return {"blocks": list(self.engine.kv.blocks_of(victim.request_id)),
                    "free": self.engine.kv.num_free_blocks, "output": list(victim.output_token_ids),
                    "prompt": list(victim.prompt_token_ids), "computed": victim.num_computed_tokens,
                    "status": victim.status, "waiting": list(scheduler.waiting)}

        def spy(sched: Scheduler, victim: Request) -> None:
            before = watched(victim)
            fn(sched, victim)
            if not self.seen:
                self.seen.append({"victim": victim, "before": before, "after": watched(victim)})

        use_in(scheduler, spy)
        while scheduler.has_unfinished() and not self.seen and self.engine.steps < 200:
            self.engine.step()
        if not self.seen:
            raise LabFailure("no request was preempted in a pool too small for three growing requests: the check "
                             "cannot watch your preempt().")
        first = self.seen[0]
        self.victim: Request = first["victim"]
        self.before: dict = first["before"]
        self.after: dict = first["after"]


def blocks_go_back(fn: Any) -> None:
    """the victim's blocks go back to the pool (a preempted request that keeps them leaks them)"""
    seen = FirstPreemption(fn)
    expect(not seen.after["blocks"] and seen.after["free"] == seen.before["free"] + len(seen.before["blocks"]),
           f"request {seen.victim.request_id} held {len(seen.before['blocks'])} blocks when it was preempted and "
           f"still holds {len(seen.after['blocks'])} after it; the pool's free blocks went from "
           f"{seen.before['free']} to {seen.after['free']}. A preempted request that keeps its blocks is a leak: "
           f"preemption happened because the pool was empty, and the blocks never return (the request will be "
           f"given fresh ones when it is admitted again). Give them back with scheduler.kv.free(victim, ...).")


def generated_tokens_kept(fn: Any) -> None:
    """the victim keeps the tokens it generated (only its KV is dropped)"""
    seen = FirstPreemption(fn)
    expect(seen.after["prompt"] == seen.before["prompt"] and seen.after["output"] == seen.before["output"],
           f"request {seen.victim.request_id} had generated {len(seen.before['output'])} tokens when it was "
           f"preempted and has {len(seen.after['output'])} after it. A preempted request that loses its generated "
           f"tokens changes its outputs: the client already has them, so it receives them twice, max_tokens is "
           f"counted again from zero, and a sampled request draws different ones. Recompute drops only the KV: "
           f"the tokens stay, and their KV is recomputed when it comes back.")


def recomputes_from_zero(fn: Any) -> None:
    """it waits with num_computed_tokens = 0: every token's KV is recomputed when it comes back"""
    seen = FirstPreemption(fn)
    expect(seen.after["computed"] == 0,
           f"after the preemption request {seen.victim.request_id} says {seen.after['computed']} of its tokens have "
           f"KV, but its blocks are gone: the next admission would start at token {seen.after['computed']} and "
           f"attend to KV that does not exist. Set num_computed_tokens to 0.")
    expect(seen.after["status"] is RequestStatus.WAITING,
           f"after the preemption request {seen.victim.request_id} has status {seen.after['status']}; it waits to "
           f"be admitted again: RequestStatus.WAITING.")


def front_of_the_queue(fn: Any) -> None:
    """the victim goes back at the front of the waiting queue, before newcomers"""
    seen = FirstPreemption(fn)
    waiting = seen.after["waiting"]
    expect(seen.victim in waiting,
           f"request {seen.victim.request_id} is not in scheduler.waiting after the preemption: nobody will ever "
           f"admit it again.")
    expect(waiting[0] is seen.victim,
           f"request {seen.victim.request_id} went back at position {waiting.index(seen.victim)} of the waiting "
           f"queue, behind {len(waiting) - 1} requests that arrived after it. A preempted request put at the back "
           f"of the queue loses its turn: under a steady stream it may starve (be preempted and requeued behind "
           f"newcomers forever), and first-come first-served order is broken. It arrived first: appendleft.")


def oversubscribed_workload_completes(fn: Any) -> None:
    """a whole oversubscribed workload (made-up tokens): everyone finishes with its tokens, every block returns"""
    engine = MadeUpEngine(num_blocks=10, max_num_batched_tokens=32)
    for i in range(8):
        engine.add(prompt_len=5 + 3 * i % 11, max_tokens=14)
    use_in(engine.scheduler, fn)
    engine.run()
    preemptions = engine.scheduler.num_preemptions["recompute"]
    expect(preemptions > 0, "the workload ran without a preemption: the check cannot judge your preempt().")
    for req in engine.requests:
        want = expected_tokens(req.num_prompt_tokens, req.arrival_index, req.params.max_tokens)
        expect(list(req.output_token_ids) == want,
               f"after {preemptions} preemptions request {req.request_id} ended with {len(req.output_token_ids)} "
               f"tokens that differ from a run without preemption; a preempted request keeps its generated tokens.")
    expect(engine.kv.num_free_blocks == engine.num_blocks,
           f"every request finished, yet {engine.num_blocks - engine.kv.num_free_blocks} of {engine.num_blocks} "
           f"blocks are not free: a preempted request kept its blocks (a leak).")


def outputs_match_the_engines_own(fn: Any) -> None:
    """on a tiny model, an oversubscribed pool: greedy outputs equal the engine's own, with preemptions"""
    require(fn, blocks_go_back, generated_tokens_kept, recomputes_from_zero, front_of_the_queue,
            oversubscribed_workload_completes)
    prompts = [[(7 * i + t) % 250 for t in range(6 + 2 * i)] for i in range(6)]
    options = {"num_blocks": 12, "max_num_batched_tokens": 32, "preemption_mode": "recompute",
               "attention_backend": "torch"}
    _, want, _ = greedy_run(None, prompts, 16, **options)
    engine, got, events = greedy_run(lambda e: install(e, fn), prompts, 16, **options)
    preempted = sum(len(ev.preempted) for ev in events)
    expect(preempted > 0, "12 blocks of 4 tokens for six requests growing to 9 blocks each, and nobody was "
                          "preempted: the check cannot judge your preempt().")
    for i, (g, w) in enumerate(zip(got, want)):
        expect(g == w, f"after {preempted} preemptions, request {i}'s greedy tokens are {g}; with the engine's own "
                       f"preemption they are {w}. Recompute must give exactly the tokens a run without preemption "
                       f"gives.")
    expect(engine.kv.num_free_blocks == 12, "every request finished, yet some blocks are not free: a leak.")


def reference() -> Any:
    return engine_preempt


def engine_preempt(scheduler: Scheduler, victim: Request) -> None:
    """The engine's own recompute preemption (``Scheduler._preempt``'s recompute branch), as the lab's function."""
    scheduler.running.remove(victim)
    scheduler.kv.free(victim, forget_hashes=False)
    victim.num_computed_tokens = 0
    victim.status = RequestStatus.WAITING
    scheduler.waiting.appendleft(victim)


LAB = Lab(6, "lab6_preemption", "Preemption by recompute", "preempt", STUB, reference,
          (blocks_go_back, generated_tokens_kept, recomputes_from_zero, front_of_the_queue,
           oversubscribed_workload_completes, outputs_match_the_engines_own),
          reference_options={"preemption_mode": "recompute"},
          install=install)
