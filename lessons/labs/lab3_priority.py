"""Lab 3: a scheduling policy, vLLM's priority order.

The student writes ``MyPriority``, a ``minipaged.policies.RequestOrder`` (the engine's own is
``PriorityOrder``). The checks put it into the engine's real ``Scheduler`` (no model needed: each step's
sampled token is made up) and watch the order in which requests are admitted to a one-seat engine.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any, Sequence

from minipaged.kv_cache_manager import KVCacheManager
from minipaged.swap import CpuBlockPool
from minipaged.config import EngineConfig
from minipaged.policies import LRUFreeBlockQueue, Newest, PriorityOrder
from minipaged.request import Request, SamplingParams
from minipaged.scheduler import Scheduler
from minipaged.workloads import Workload

from .core import Lab, expect

STUB = '''"""Lab 3: vLLM's priority scheduling. Fill in the TODO, then run `minipaged lab check 3`.

When several requests wait, the engine admits the one whose key() is smallest. vLLM's rule for
--scheduling-policy priority: the lower request.params.priority, the sooner; among equal priorities, the
one that arrived first (request.arrival_index counts arrivals: 0, 1, 2 ...).
"""
from minipaged.policies import RequestOrder


class MyPriority(RequestOrder):
    def key(self, request):
        """Smaller keys are admitted first. A tuple compares element by element."""
        # TODO
        raise NotImplementedError("MyPriority.key")
'''


class OneSeatEngine:
    """The engine's Scheduler and KV pool, one request at a time, tokens made up: admissions are what we watch."""

    def __init__(self, order: Any) -> None:
        config = EngineConfig(model="lab", num_blocks=64, block_size=4, max_num_seqs=1, max_num_batched_tokens=64)
        config.finalize(model_max_len=256)
        self.scheduler = Scheduler(config, KVCacheManager(64, 4, free_queue=LRUFreeBlockQueue), CpuBlockPool(0),
                                   order=order, victim_policy=Newest())
        self.admitted: list[str] = []
        self.count = 0

    def add(self, priority: int, max_tokens: int = 3) -> str:
        rid = str(self.count)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, priority=priority)
        request = Request(rid, [1, 2, 3, 4, 5], params, self.count, 0.0)
        self.scheduler.order.key(request)    # a key that raises shows here, not as a request the scheduler aborts
        self.scheduler.add(request)
        self.count += 1
        return rid

    def step(self) -> None:
        out = self.scheduler.schedule()
        self.admitted += [c.request.request_id for c in out.chunks if c.request.request_id not in self.admitted]
        self.scheduler.update_from_output(out, {c.request.request_id: [7] for c in out.chunks if c.samples})

    def run(self) -> list[str]:
        while self.scheduler.has_unfinished():
            self.step()
        return self.admitted


def order_of(cls: Any, priorities: Sequence[int]) -> list[str]:
    engine = OneSeatEngine(cls())
    for p in priorities:
        engine.add(p)
    return engine.run()


def lower_value_first(cls: Any) -> None:
    """a lower priority value is admitted first"""
    got = order_of(cls, [3, -1, 0])
    expect(got != ["0", "1", "2"], "you admitted the requests in arrival order although their priorities were 3, -1 "
                                   "and 0: the key ignores request.params.priority.")
    expect(got != ["0", "2", "1"], "you admitted priority 3 first and -1 last: vLLM serves the *lower* value first "
                                   "(think 'rank 1 is the top'). Use the priority itself, not its negative.")
    expect(got == ["1", "2", "0"], f"requests of priority 3, -1, 0 were admitted as {got}; expected -1, then 0, then 3 "
                                   f"(request ids 1, 2, 0).")


def equal_priorities_first_come_first_served(cls: Any) -> None:
    """among equal priorities the earliest arrival goes first, so nobody waits forever"""
    engine = OneSeatEngine(cls())
    first = engine.add(0)
    for _ in range(12):                   # a new request of the same priority arrives every step
        engine.step()
        engine.add(0)
    expect(first in engine.admitted and engine.admitted[:2] == ["0", "1"],
           f"with a new request of the same priority arriving every step, the admissions went {engine.admitted}. "
           f"Among equals you admit the newest first: under a steady stream the oldest waiting request is never "
           f"admitted, it starves. Break ties by request.arrival_index, smallest first.")


def late_urgent_request_overtakes(cls: Any) -> None:
    """a late request of lower value overtakes the requests already waiting"""
    engine = OneSeatEngine(cls())
    for _ in range(4):
        engine.add(0)
    engine.step()                         # "0" runs, 1-3 wait
    urgent = engine.add(-5)
    got = engine.run()
    expect(got == ["0", urgent, "1", "2", "3"], f"admissions were {got}: the priority -5 request that arrived late "
                                                f"should have been next after the running one.")


def reference() -> Any:
    return PriorityOrder


def with_priorities(workload: Workload) -> Workload:
    """The watch workload with priorities -1 to 2 drawn per request (a preset has none), so the order shows."""
    rng = random.Random(0)
    arrivals = tuple(dataclasses.replace(a, params=dataclasses.replace(a.params, priority=rng.randint(-1, 2)))
                     for a in workload.arrivals)
    return dataclasses.replace(workload, arrivals=arrivals, description=workload.description
                               + " Each request has a priority from -1 (first) to 2.")


LAB = Lab(3, "lab3_priority", "A scheduling policy: vLLM's priority order", "MyPriority", STUB, reference,
          (lower_value_first, equal_priorities_first_come_first_served, late_urgent_request_overtakes),
          watch_options=lambda path: {"scheduling_policy": f"{path}:MyPriority"},
          reference_options={"scheduling_policy": "priority", "preemption_victim": "lowest-priority"},
          adapt_workload=with_priorities)
