"""Fair share by client (``--fair-share``, minipaged/policies/client_share.py): issue 48's cases in miniature.

The scheduler is driven on its own (no model: every request that samples gets token 7), so each test sees who
got how many tokens in which step. A "victim" client decodes throughout while a "greedy" one sends a burst of
prompts of exactly the threshold, chunks over a long cached prefix, or n samples that outgrow the pool; the
victim's decode must get its token every step, no step's prefill may pass the allowance, and the victim is
never preempted while the greedy client holds more. The last test checks greedy outputs on the tiny model.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Optional

import pytest

from minipaged import SamplingParams
from minipaged.config import EngineConfig
from minipaged.kv_cache_manager import KVCacheManager
from minipaged.policies import FCFS, LRUFreeBlockQueue, Newest
from minipaged.policies.client_share import ClientShare
from minipaged.request import Request, RequestStatus
from minipaged.scheduler import Scheduler
from minipaged.swap import CpuBlockPool
from tests.conftest import step_until_done

BLOCK = 16
THRESHOLD = 32
CONTEXT_PER_TOKEN = 300              # context positions that cost one token (the tiny model's shape gives ~290)


class Bench:
    """A scheduler with or without fair share; a step 'samples' token 7 for every chunk that samples."""

    def __init__(self, fair: bool, num_blocks: int = 4096, **options) -> None:
        options = {"max_num_batched_tokens": 2048, "long_prefill_token_threshold": THRESHOLD, **options}
        config = EngineConfig(model="unit", block_size=BLOCK, num_blocks=num_blocks, fair_share=fair, **options)
        config.validate()
        config.finalize(model_max_len=32768)
        self.kv = KVCacheManager(num_blocks, BLOCK, free_queue=LRUFreeBlockQueue)
        self.scheduler = Scheduler(config, self.kv, CpuBlockPool(0), order=FCFS(), victim_policy=Newest(),
                                   client_share=ClientShare(CONTEXT_PER_TOKEN) if fair else None)
        self.count = 0
        self.steps: list[list[tuple[Request, int, int]]] = []     # per step: (request, start, tokens)

    def add(self, client: Optional[str], prompt: list[int], n: int = 1, max_tokens: int = 4) -> list[Request]:
        params = SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens, ignore_eos=True, client=client)
        parent = str(self.count)
        reqs = [Request(parent if n == 1 else f"{parent}.{i}", list(prompt), params, self.count * 1000 + i, 0.0,
                        sample_index=i, parent_id=parent) for i in range(n)]
        for req in reqs:
            self.scheduler.add(req)
        self.count += 1
        return reqs

    def step(self) -> None:
        out = self.scheduler.schedule()
        self.scheduler.update_from_output(out, {c.request.request_id: [7] for c in out.chunks if c.samples})
        self.kv.check_invariants()
        self.steps.append([(c.request, c.start, c.num_new_tokens) for c in out.chunks])

    def run_while(self, req: Request, limit: int = 5000) -> None:
        while not req.is_finished and len(self.steps) < limit:
            self.step()
        assert req.is_finished

    def decoding_steps(self, req: Request) -> list[list[tuple[Request, int, int]]]:
        """The steps from the one after ``req``'s prefill to its end."""
        first = next(i for i, step in enumerate(self.steps) if any(r is req for r, _s, _n in step))
        last = max(i for i, step in enumerate(self.steps) if any(r is req for r, _s, _n in step))
        return self.steps[first + 1:last + 1]

    def prefills(self, step: list[tuple[Request, int, int]]) -> list[tuple[Request, int, int]]:
        return [(r, start, n) for r, start, n in step if n > 1 or start < r.num_prompt_tokens]


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def test_a_burst_of_threshold_sized_prompts_cannot_take_the_step():
    """16 prompts of exactly the threshold are not 'long', so without fair share they all prefill in one step;
    with it, a step's prefills together stay within the threshold and the victim decodes every step."""
    bench = Bench(fair=True)
    victim, = bench.add("victim", tokens(0, 20), max_tokens=40)
    bench.step()                                         # its prefill
    burst = [bench.add("greedy", tokens(1 + i, THRESHOLD))[0] for i in range(16)]
    bench.run_while(victim)
    for step in bench.decoding_steps(victim):
        assert any(r is victim for r, _s, _n in step), "the victim's decode got a token every step"
        assert sum(n for _r, _s, n in bench.prefills(step)) <= THRESHOLD
    assert all(r.num_computed_tokens >= THRESHOLD for r in burst), "the burst was served meanwhile"


def test_chunks_over_a_cached_prefix_pay_for_their_context():
    """A cached 600-token prefix, then 12 requests of 30 new tokens each: each token of theirs attends to 600
    positions, so a step grants fewer of them; the step's context-weighted prefill stays within the threshold."""
    bench = Bench(fair=True)
    prefix = tokens(2, 600)
    first, = bench.add("greedy", prefix, max_tokens=1)
    bench.run_while(first)                               # the prefix is cached now
    victim, = bench.add("victim", tokens(3, 20), max_tokens=40)
    bench.step()
    followers = [bench.add("greedy", prefix + tokens(10 + i, 30))[0] for i in range(12)]
    bench.run_while(victim)
    costs = []
    for step in bench.decoding_steps(victim):
        assert any(r is victim for r, _s, _n in step), "the victim's decode got a token every step"
        cost = sum(-(-n * (CONTEXT_PER_TOKEN + start) // CONTEXT_PER_TOKEN) for _r, start, n in bench.prefills(step))
        costs.append(cost)
        assert cost <= THRESHOLD
    assert max(costs) > THRESHOLD // 2, "the allowance was used, not left idle"
    assert any(r.num_cached_tokens >= 592 for r in followers), "the followers hit the cached prefix"


def test_many_samples_decode_in_turns_beside_the_victim():
    """n=64 samples of one client beside a victim's one stream: a step decodes the victim's row, the greedy
    client's rows up to half the allowance, prefills in the rest; the step's work stays within the allowance.
    The greedy samples with the fewest tokens decode first, and all of them finish. Without fair share every
    sample decodes every step (the step the victim waits for grows with n)."""
    def run(fair: bool) -> tuple[Bench, Request, list[Request], list[int]]:
        bench = Bench(fair=fair)
        victim, = bench.add("victim", tokens(0, 20), max_tokens=60)
        bench.step()
        greedy = bench.add("greedy", tokens(8, 40), n=64, max_tokens=12)
        rows = []
        while not all(r.is_finished for r in greedy + [victim]):
            waiting_rows = {id(r): len(r.output_token_ids) for r in greedy
                            if r.status is RequestStatus.RUNNING and not r.is_prefill}
            bench.step()
            decoded = [waiting_rows.pop(id(r)) for r, _s, _n in bench.steps[-1] if id(r) in waiting_rows]
            if not victim.is_finished:                   # contended: two clients have requests
                rows.append(len(decoded))
            if fair and decoded and waiting_rows:       # the rows that waited had at least as many tokens
                assert max(decoded) <= min(waiting_rows.values()) + 1
        return bench, victim, greedy, rows

    bench, victim, greedy, rows = run(fair=True)
    for step in bench.decoding_steps(victim):
        assert any(r is victim for r, _s, _n in step), "the victim's decode got a token every step"
        work = sum(n * (CONTEXT_PER_TOKEN + start) / CONTEXT_PER_TOKEN for _r, start, n in step)
        assert work <= THRESHOLD + 3, "the step's work stays within the allowance (and the victim's own row)"
    assert max(rows) <= THRESHOLD // 2 and max(rows) >= THRESHOLD // 4, "half the allowance, used"
    assert all(len(r.output_token_ids) == 12 for r in greedy)
    assert bench.kv.num_free_blocks == bench.kv.num_blocks
    _bench, _victim, _greedy, plain_rows = run(fair=False)
    assert max(plain_rows) >= 60


@pytest.mark.parametrize("samples", [True, False], ids=["n=8-samples", "3-requests"])
def test_a_client_outgrowing_the_pool_preempts_its_own_requests_not_the_victim(samples):
    """n=8 samples (or 3 requests) that grow past the pool, and a victim that arrived after them (the newest
    request: vLLM's victim). With fair share the greedy client, holding the most blocks, loses its own requests
    and the victim decodes every step, never preempted. (With 3 requests the victim runs out of room while the
    greedy ones need none: they are still unscheduled because the lightest client's decodes go first.)"""
    def run(fair: bool) -> tuple[Request, list[Request], Bench]:
        bench = Bench(fair=fair, num_blocks=32 if samples else 9)
        if samples:
            greedy = bench.add("greedy", tokens(4, 64), n=8, max_tokens=200)
        else:
            greedy = [bench.add("greedy", tokens(40 + i, 16), max_tokens=100)[0] for i in range(3)]
        victim, = bench.add("victim", tokens(5, 8), max_tokens=60)
        bench.run_while(victim)
        return victim, greedy, bench

    victim, greedy, bench = run(fair=True)
    assert victim.num_preemptions == 0
    assert sum(r.num_preemptions for r in greedy) > 0, "the pool ran dry: the greedy client paid for it"
    for step in bench.decoding_steps(victim):
        assert any(r is victim for r, _s, _n in step), "the victim's decode got a token every step"
    plain_victim, _greedy, _bench = run(fair=False)
    assert plain_victim.num_preemptions > 0, "without fair share the newest request, the victim's, is taken"


def test_a_newcomer_takes_its_share_of_a_full_pool_back():
    """n=8 samples of one client fill the pool; another client's request arrives then. With fair share it preempts
    a greedy sample and starts at once (its client holds nothing, the greedy one all); without, admission never
    preempts (vLLM's rule) and it waits until the greedy samples have finished. Every block is free at the end."""
    def wait_for_newcomer(fair: bool) -> tuple[int, int]:
        bench = Bench(fair=fair, num_blocks=32)
        greedy = bench.add("greedy", tokens(4, 64), n=8, max_tokens=120)
        while bench.kv.num_free_blocks > 0:
            bench.step()
        newcomer, = bench.add("newcomer", tokens(5, 20), max_tokens=4)
        arrived = len(bench.steps)
        bench.run_while(newcomer)
        started = next(i for i, step in enumerate(bench.steps) if any(r is newcomer for r, _s, _n in step))
        while bench.scheduler.has_unfinished():
            bench.step()
        assert bench.kv.num_free_blocks == bench.kv.num_blocks
        assert all(len(r.output_token_ids) == 120 for r in greedy)
        return started - arrived, sum(r.num_preemptions for r in greedy)

    waited, preempted = wait_for_newcomer(fair=True)
    assert waited == 0 and preempted > 0
    plain_waited, _ = wait_for_newcomer(fair=False)
    assert plain_waited > 20


def test_the_block_kept_for_a_newcomer_is_not_taken_by_the_client_over_its_share():
    """A pool of 10 blocks; the greedy client's one request holds 9 and its next token needs the 10th, in the step
    a newcomer (another client, holding nothing) arrives needing one. The block is kept for the newcomer: the
    greedy request, over its share, preempts itself, and the newcomer is admitted in that same step."""
    bench = Bench(fair=True, num_blocks=10)
    greedy, = bench.add("greedy", tokens(9, 9 * BLOCK), max_tokens=8)
    while greedy.num_computed_tokens < 9 * BLOCK:
        bench.step()
    assert bench.kv.num_free_blocks == 1
    newcomer, = bench.add("newcomer", tokens(10, 10), max_tokens=4)
    bench.step()
    assert [r for r, _s, _n in bench.steps[-1]] == [newcomer]
    assert greedy.num_preemptions == 1
    while bench.scheduler.has_unfinished():
        bench.step()
    assert len(greedy.output_token_ids) == 8 and bench.kv.num_free_blocks == bench.kv.num_blocks


def test_two_clients_near_their_shares_do_not_take_blocks_from_each_other_in_turn():
    """A 10-block pool, a share of 5 each: A holds 6, B 4, none free, and B sends a 2-block request. Taking A's
    request for it would put B over its share and A's request would take it back the next step, and so on (a
    review found 9 preemptions in 10 steps): B's request waits for free blocks instead, and nobody is preempted."""
    bench = Bench(fair=True, num_blocks=10)
    a1, = bench.add("A", tokens(1, 50), max_tokens=12)
    a2, = bench.add("A", tokens(2, 18), max_tokens=12)
    b1, = bench.add("B", tokens(3, 50), max_tokens=12)
    while not all(r.num_computed_tokens >= r.num_prompt_tokens for r in (a1, a2, b1)):
        bench.step()
    assert bench.kv.num_free_blocks == 0
    b2, = bench.add("B", tokens(4, 18), max_tokens=12)
    while bench.scheduler.has_unfinished():
        bench.step()
    assert sum(r.num_preemptions for r in (a1, a2, b1, b2)) == 0
    assert bench.kv.num_free_blocks == bench.kv.num_blocks


def test_a_request_over_its_share_that_does_not_fit_lets_the_newcomer_behind_it_in():
    """A holds 12 of 19 blocks (over its share), B 4, 3 are free, and both send a 2-block request, A's first in
    the turns. A's may not take the 2 blocks kept for B's; it waits, and B's is admitted in the same step."""
    bench = Bench(fair=True, num_blocks=19)
    bench.add("A", tokens(1, 145), max_tokens=200)
    bench.add("A", tokens(2, 17), max_tokens=200)
    for _ in range(5):
        bench.step()
    b1, = bench.add("B", tokens(3, 60), max_tokens=200)
    while b1.num_computed_tokens < 60:
        bench.step()
    assert bench.kv.num_free_blocks == 3
    a_new, = bench.add("A", tokens(4, 32), max_tokens=200)
    b_new, = bench.add("B", tokens(5, 32), max_tokens=4)
    bench.step()
    assert any(r is b_new for r, _s, _n in bench.steps[-1]) and not any(r is a_new for r, _s, _n in bench.steps[-1])


def test_admission_takes_turns_between_clients():
    """16 samples of one client ahead of another client's one request, 4 sequences at a time: the second
    client's request is admitted at the first free slot, not after the 16 samples (FCFS within a client)."""
    def victim_admitted_after(fair: bool) -> int:
        bench = Bench(fair=fair, max_num_seqs=4)
        greedy = bench.add("greedy", tokens(6, 20), n=16, max_tokens=3)
        victim, = bench.add("victim", tokens(7, 20), max_tokens=3)
        bench.run_while(victim)
        order = list(dict.fromkeys(r for step in bench.steps for r, _s, _n in step))     # by first chunk
        assert [r for r in order if r is not victim] == greedy[:len(order) - 1], "FCFS within a client"
        return order.index(victim)

    assert victim_admitted_after(fair=True) <= 4
    assert victim_admitted_after(fair=False) >= 12


def test_one_client_alone_is_scheduled_as_without_fair_share():
    """No contention, no change: one client's mixed workload (long prompts, n samples, a pool that runs dry)
    gets the very same steps with fair share on as off."""
    def steps(fair: bool) -> list[list[tuple[str, int, int]]]:
        bench = Bench(fair=fair, num_blocks=48)
        for i in range(10):
            bench.add("alone", tokens(20 + i, 10 + 37 * i), n=1 + i % 3, max_tokens=30)
        while bench.scheduler.has_unfinished():
            bench.step()
        assert bench.kv.num_free_blocks == bench.kv.num_blocks
        assert sum(r.num_preemptions for step in bench.steps for r, _s, _n in step) > 0
        return [[(r.request_id, s, n) for r, s, n in step] for step in bench.steps]

    assert steps(fair=True) == steps(fair=False)


def test_greedy_outputs_are_identical_with_fair_share(tiny_engine_factory):
    """Three clients, a small pool (preemptions) and a small threshold: the same tokens as the plain engine."""
    rng = random.Random(48)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 40))] for _ in range(9)]
    base = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    params = [dataclasses.replace(base, client=f"student-{i % 3}", n=1 + (i == 4)) for i in range(len(prompts))]

    def run(**options) -> list[list[list[int]]]:
        engine = tiny_engine_factory(num_blocks=24, long_prefill_token_threshold=8, **options)
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        outputs = step_until_done(engine)
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        assert sum(engine.scheduler.num_preemptions.values()) > 0, "the pool ran dry: victims were chosen"
        assert (engine.scheduler.client_share is not None) == bool(options.get("fair_share"))
        return [[list(s.token_ids) for s in outputs[i].outputs] for i in ids]

    assert run(fair_share=True) == run()


def test_a_client_over_its_fair_share_evicts_only_itself():
    """Three clients share 30 blocks (10 each): one holding 11 that needs room takes from itself even though
    another holds 18; holding 9, it takes from the one holding the most (blocks its requests share count once)."""
    reqs = {c: [Request(f"{c}{i}", [1, 2], SamplingParams(client=c), 10 * i + k, 0.0) for i in range(2)]
            for k, c in enumerate(("greedy", "medium", "victim"))}
    everyone = [r for rs in reqs.values() for r in rs]
    step = ClientShare().begin_step([everyone], threshold=0)

    def victims(medium_blocks: int) -> list[Request]:
        blocks = {"greedy0": range(10), "greedy1": range(2, 18), "medium0": range(100, 100 + medium_blocks),
                  "medium1": range(100, 103), "victim0": [200], "victim1": []}
        return step.victims(everyone, reqs["medium"][0], everyone, lambda rid: list(blocks[rid]), 30)

    assert victims(11) == reqs["medium"]
    assert victims(9) == reqs["greedy"]
