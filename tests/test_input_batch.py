"""The persistent batch (minipaged/runner/input_batch.py) lays out a decode step exactly as the general path does,
step after step, while requests come and go, tables grow, and a preempted request comes back with new blocks."""
from __future__ import annotations

import random

import torch

from minipaged import SamplingParams
from minipaged.kernels.backends import TORCH_BACKEND
from minipaged.request import Request
from minipaged.runner.input_batch import plain_decodes
from minipaged.runner.model_runner import ModelInput, ModelRunner
from minipaged.scheduler import ScheduledChunk

BLOCK = 4


def assert_same_inputs(fast: ModelInput, general: ModelInput) -> None:
    for name in ("input_ids", "positions", "logits_indices"):
        a, b = getattr(fast, name), getattr(general, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        a, b = getattr(fast.meta, name), getattr(general.meta, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert fast.meta.host_seq_lens == general.meta.host_seq_lens
    assert fast.meta.host_query_start_loc == general.meta.host_query_start_loc
    assert fast.meta.all_slots_new == general.meta.all_slots_new
    assert fast.sampled_requests == general.sampled_requests and fast.num_logits_rows == general.num_logits_rows
    assert fast.prompt_rows == general.prompt_rows


class FakeCache:
    """Hands out block ids: a request's table grows by one block when its tokens fill the last one."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.tables: dict[str, list[int]] = {}

    def table_for(self, req: Request) -> tuple[int, ...]:
        table = self.tables.setdefault(req.request_id, [])
        while len(table) * BLOCK < req.num_tokens:
            table.append(self.rng.randrange(10_000))
        return tuple(table)


def test_decode_steps_lay_out_the_same_inputs_as_the_general_path_whatever_comes_and_goes():
    rng = random.Random(0)
    runner = ModelRunner(model=None, kv_cache=torch.zeros(1), block_size=BLOCK, backend=TORCH_BACKEND)
    cache = FakeCache(rng)
    running: list[Request] = []
    next_id = 0
    for step in range(120):
        # requests arrive (up to 150 at once: more rows than the batch starts with), finish, and get preempted
        for _ in range(rng.randint(0, 12 if step < 40 else 3)):
            prompt = [rng.randrange(300) for _ in range(rng.randint(1, 9))]
            req = Request(f"r{next_id}", prompt, SamplingParams(), next_id, 0.0, output_token_ids=[rng.randrange(300)])
            next_id += 1
            running.append(req)
        if running and rng.random() < 0.3:
            running.remove(rng.choice(running))
        if running and rng.random() < 0.2:
            cache.tables.pop(rng.choice(running).request_id, None)   # preempted and back: all new blocks
        rng.shuffle(running) if rng.random() < 0.1 else None   # another order (a policy's)
        chunks = [ScheduledChunk(r, r.num_tokens - 1, 1, block_table=cache.table_for(r), samples=True)
                  for r in running if rng.random() < 0.9]       # some are not scheduled this step
        if not chunks:
            continue
        assert plain_decodes(chunks)
        assert_same_inputs(runner.prepare(chunks), runner._prepare_any(chunks))
        for r in running:
            r.output_token_ids.append(rng.randrange(300))
    assert max(len(t) for t in cache.tables.values()) > 16            # tables grew past the first width


def test_only_plain_decode_steps_take_the_persistent_path():
    decode = Request("d", [1, 2, 3], SamplingParams(), 0, 0.0, output_token_ids=[4])
    prompt = Request("p", [1, 2, 3], SamplingParams(), 1, 0.0)
    plain = ScheduledChunk(decode, 3, 1, block_table=(5,), samples=True)
    assert plain_decodes([plain])
    assert not plain_decodes([plain, ScheduledChunk(prompt, 0, 3, block_table=(6,), samples=True)])
    assert not plain_decodes([ScheduledChunk(prompt, 2, 1, block_table=(6,), samples=True)])   # last prompt token
    assert not plain_decodes([ScheduledChunk(decode, 3, 2, block_table=(5,), samples=True,
                                             spec_token_ids=(9,))])                        # a draft to verify
    assert not plain_decodes([ScheduledChunk(decode, 3, 1, block_table=(5,), samples=True, cached_prefix_end=4)])
