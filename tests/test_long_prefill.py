"""A long prompt shares the step: vLLM's long_prefill_token_threshold, max_long_partial_prefills and
max_num_partial_prefills, and the samples of an n > 1 request sharing their prompt (minipaged/scheduler.py).

The scheduler is driven on its own here (no model: a step's "forward pass" samples token 7), so each test
sees exactly which request got how many tokens in which step. The engine tests at the end check that none
of it changes greedy outputs.
"""
from __future__ import annotations

import random

import pytest

from minipaged import SamplingParams
from minipaged.kv_cache_manager import KVCacheManager
from minipaged.policies import FCFS, LRUFreeBlockQueue, Newest
from minipaged.swap import CpuBlockPool
from minipaged.config import LONG_PREFILL_CPU, ConfigError, EngineConfig
from minipaged.request import Request
from minipaged.scheduler import Scheduler

BLOCK = 16


class Bench:
    """A scheduler over a pool big enough for everything, and a step that 'samples' token 7 for every request
    whose chunk reached the end of its known tokens."""

    def __init__(self, **options) -> None:
        options.setdefault("max_num_batched_tokens", 2048)
        config = EngineConfig(model="unit", block_size=BLOCK, num_blocks=4096, **options)
        config.validate()
        config.finalize(model_max_len=32768)
        self.kv = KVCacheManager(4096, BLOCK, free_queue=LRUFreeBlockQueue)
        self.scheduler = Scheduler(config, self.kv, CpuBlockPool(0), order=FCFS(), victim_policy=Newest())
        self.count = 0

    def add(self, num_tokens: int, n: int = 1, max_tokens: int = 4, seed: int = 0) -> list[Request]:
        rng = random.Random(seed)
        prompt = [rng.randrange(1000) for _ in range(num_tokens)]
        params = SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        parent = str(self.count)
        reqs = [Request(parent if n == 1 else f"{parent}.{i}", list(prompt), params, self.count * 100 + i, 0.0,
                        sample_index=i, parent_id=parent) for i in range(n)]
        for req in reqs:
            self.scheduler.add(req)
        self.count += 1
        return reqs

    def step(self) -> dict[str, int]:
        """One step; returns {request id: tokens scheduled}."""
        out = self.scheduler.schedule()
        self.scheduler.update_from_output(out, {c.request.request_id: [7] for c in out.chunks if c.samples})
        self.kv.check_invariants()
        return {c.request.request_id: c.num_new_tokens for c in out.chunks}

    def run(self, max_steps: int = 10_000) -> list[dict[str, int]]:
        steps = []
        while self.scheduler.has_unfinished() and len(steps) < max_steps:
            steps.append(self.step())
        assert not self.scheduler.has_unfinished()
        assert self.kv.num_free_blocks == self.kv.num_blocks, "every block is free at the end"
        return steps


def first_step_with(steps: list[dict[str, int]], request_id: str) -> int:
    return next(i for i, step in enumerate(steps) if request_id in step)


def test_a_long_prompt_gets_at_most_the_threshold_per_step():
    bench = Bench(long_prefill_token_threshold=512)
    [long] = bench.add(7000)
    steps = bench.run()
    prefill = [step["0"] for step in steps if step["0"] > 1]
    assert prefill == [512] * 13 + [7000 - 13 * 512]     # 7,000 tokens in 14 chunks, never more than 512


def test_a_short_request_is_served_while_an_n10_long_prompt_prefills():
    """The issue's case: a 16-token request arriving one step into a 7,000-token n=10 request starts at once
    and decodes every step, instead of waiting behind all of the long prompt's prefill (4 steps here, seconds
    each with SmolLM2 on a CPU)."""
    bench = Bench(long_prefill_token_threshold=256)
    bench.add(7000, n=10)
    steps = [bench.step()]
    [short] = bench.add(16, max_tokens=8, seed=1)
    steps += bench.run()
    arrival = 1
    assert steps[arrival]["1"] == 16, "admitted in the first step after it arrived"
    decoding = steps[arrival + 1:arrival + 8]
    assert all(step.get("1") == 1 for step in decoding), "a decode token every step until it finishes"
    assert all(step.get("0.0", 0) == 256 for step in decoding), "while the long prompt is still prefilling"


def test_the_samples_of_one_request_prefill_their_prompt_once():
    """The siblings wait while the first sample prefills, then find the whole prompt cached: 7,000 tokens are
    computed once, not ten times. The limit on long prefills is raised so that only the sibling rule holds
    them back."""
    bench = Bench(long_prefill_token_threshold=256, max_long_partial_prefills=10)
    bench.add(7000, n=10)
    steps = bench.run()
    prompt_work = sum(tokens for step in steps for rid, tokens in step.items() if tokens > 1)
    last_partial = 7000 - 7000 // BLOCK * BLOCK              # the prompt's tokens past its last full block
    assert prompt_work == 7000 + 9 * last_partial            # each sibling computes only the uncached tail
    leader_done = max(i for i, step in enumerate(steps) if step.get("0.0", 0) > 1)
    assert all(first_step_with(steps, f"0.{i}") == leader_done for i in range(1, 10)), \
        "admitted in the step that grants the first sample its last chunk (its blocks are published then)"


def test_long_prompts_beyond_the_limit_wait_and_keep_their_place():
    bench = Bench(long_prefill_token_threshold=256, max_long_partial_prefills=1)
    bench.add(1000)                  # 0: long
    bench.add(1000, seed=1)          # 1: long, waits for 0
    bench.add(100, seed=2)           # 2: short, goes ahead of 1
    steps = bench.run()
    assert steps[0] == {"0": 256, "2": 100}
    assert first_step_with(steps, "1") == 3, "admitted in the step that gives 0 its last chunk, no later"
    assert steps[3]["0"] == 1000 - 3 * 256

    two = Bench(long_prefill_token_threshold=256, max_long_partial_prefills=2, max_num_partial_prefills=2)
    two.add(1000)
    two.add(1000, seed=1)
    assert two.step() == {"0": 256, "1": 256}


def test_at_most_max_num_partial_prefills_prompts_are_mid_prefill():
    """Two long prompts take their capped chunks; a short prompt that the budget's rest would leave mid-prefill
    waits while two are mid-prefill, and one that fits the rest is admitted. Without the limit it takes the rest."""
    def bench_with(**limits) -> Bench:
        bench = Bench(long_prefill_token_threshold=256, max_long_partial_prefills=2, max_num_batched_tokens=600,
                      **limits)
        bench.add(1000)              # 0: long
        bench.add(1000, seed=1)      # 1: long
        bench.add(200, seed=2)       # 2: short, but only 88 tokens of budget are left
        bench.add(50, seed=3)        # 3: short, fits
        return bench

    limited = bench_with(max_num_partial_prefills=2)
    assert limited.step() == {"0": 256, "1": 256, "3": 50}
    steps = limited.run()
    assert first_step_with(steps, "2") == 2, "admitted (in the third step) once 0 and 1 reach their last chunks"
    assert bench_with().step() == {"0": 256, "1": 256, "2": 88}


def test_the_limits_do_not_apply_without_chunked_prefill():
    bench = Bench(long_prefill_token_threshold=256, enable_chunked_prefill=False, max_num_batched_tokens=32768)
    bench.add(1000)
    bench.add(1000, seed=1)
    assert bench.step() == {"0": 1000, "1": 1000}


def test_options_are_checked_and_the_threshold_defaults_by_device():
    cpu, cuda, mps = EngineConfig(), EngineConfig(), EngineConfig()
    cpu.finalize(8192)
    cuda.finalize(8192, "cuda")
    mps.finalize(8192, "mps")                   # any accelerator: its steps are fast, as CUDA's
    assert (cpu.long_prefill_token_threshold, cuda.long_prefill_token_threshold,
            mps.long_prefill_token_threshold) == (LONG_PREFILL_CPU, 0, 0)
    given = EngineConfig(long_prefill_token_threshold=64)
    given.finalize(8192, "cuda")
    assert given.long_prefill_token_threshold == 64
    with pytest.raises(ConfigError, match="long_prefill_token_threshold must be an integer >= 0"):
        EngineConfig(long_prefill_token_threshold=-1).validate()
    with pytest.raises(ConfigError, match="max_long_partial_prefills .* must not exceed max_num_partial_prefills"):
        EngineConfig(max_num_partial_prefills=1, max_long_partial_prefills=2).validate()
    with pytest.raises(ConfigError, match="max_num_partial_prefills must be a positive integer"):
        EngineConfig(max_num_partial_prefills=0).validate()


def test_greedy_outputs_do_not_change_with_long_prompt_sharing(tiny_engine_factory):
    """n=3 samples of a long prompt beside short requests: the same tokens with the threshold (and the sibling
    rule) as without, and the n greedy samples agree."""
    rng = random.Random(3)
    long_prompt = [rng.randrange(256) for _ in range(300)]
    shorts = [[rng.randrange(256) for _ in range(rng.randint(3, 20))] for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def run(**options):
        engine = tiny_engine_factory(num_blocks=512, max_num_batched_tokens=64, **options)
        ids = [engine.add_request(long_prompt, SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True))]
        ids += [engine.add_request(p, params) for p in shorts]
        from tests.conftest import step_until_done
        outputs = step_until_done(engine)
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        return [[list(s.token_ids) for s in outputs[i].outputs] for i in ids]

    plain = run(long_prefill_token_threshold=0, enable_prefix_caching=False)
    shared = run(long_prefill_token_threshold=8)
    assert shared == plain
    assert plain[0][0] == plain[0][1] == plain[0][2]
