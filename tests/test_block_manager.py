"""Property tests of the block manager: random workloads must keep the books balanced."""
from __future__ import annotations

import itertools

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minipaged.block_pool import ROOT_HASH, hash_block_tokens
from minipaged.kv_cache_manager import KVCacheManager
from minipaged.swap import CpuBlockPool
from minipaged.policies import LRUFreeBlockQueue, MRUFreeBlockQueue
from minipaged.request import Request, SamplingParams

BLOCK = 4
PARAMS = SamplingParams(max_tokens=64)
# Few distinct prefixes so that random prompts share blocks often.
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5]]


class BlockManagerMachine(RuleBasedStateMachine):
    """Allocate / append / free / cache-hit / evict / swap in random orders."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=12, block_size=BLOCK, enable_caching=True, free_queue=LRUFreeBlockQueue)
        self.cpu = CpuBlockPool(6)
        self.live: dict[str, Request] = {}
        self.swapped: dict[str, Request] = {}
        self.ids = itertools.count()

    @initialize(queue=st.sampled_from([LRUFreeBlockQueue, MRUFreeBlockQueue]))
    def eviction_policy(self, queue):
        self.kv = KVCacheManager(num_blocks=12, block_size=BLOCK, enable_caching=True, free_queue=queue)

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 3), max_size=6))
    def admit(self, prefix, tail):
        req = Request(f"r{next(self.ids)}", prefix + tail, PARAMS, 0, 0.0)
        hits, num_cached = self.kv.find_cached_prefix(req)
        assert num_cached < req.num_tokens                      # at least one token is always computed
        assert num_cached <= len(hits) * BLOCK
        free_before = self.kv.num_free_blocks
        need = self.kv.num_blocks_to_allocate(req, req.num_tokens - num_cached, num_cached, hits)
        ok = self.kv.allocate_slots(req, req.num_tokens - num_cached, start=num_cached, cached_blocks=hits)
        assert ok == (need <= free_before)
        if ok:
            req.num_computed_tokens = req.num_tokens
            self.live[req.request_id] = req
            assert self.kv.num_free_blocks == free_before - need  # admission counted exactly the uncached need
        else:
            assert self.kv.num_free_blocks == free_before       # all or nothing

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 3))
    def append_token(self, data, token):
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        req.output_token_ids.append(token)
        if self.kv.allocate_slots(req, 1):
            req.num_computed_tokens += 1
        else:
            req.output_token_ids.pop()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        req = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.kv.free(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap_out(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        if self.kv.swap_out(self.live[rid], self.cpu) is not None:
            self.swapped[rid] = self.live.pop(rid)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        rid = data.draw(st.sampled_from(sorted(self.swapped)))
        req = self.swapped[rid]
        if self.kv.can_swap_in(req, self.cpu):
            mapping = self.kv.swap_in(req, self.cpu)
            assert len(mapping) == self.kv.blocks_needed(req.num_computed_tokens)
            self.live[rid] = self.swapped.pop(rid)

    @rule()
    def reset_cache(self):
        self.kv.reset_prefix_cache()
        assert not self.kv.pool.hash_to_block

    @invariant()
    def books_balance(self):
        self.kv.check_invariants()
        # the counts every step's event reads are kept as blocks move (O(1)); here they are recounted
        free = list(self.kv.pool.free_queue)
        assert self.kv.num_free_blocks == len(free)
        assert self.kv.num_cached_free_blocks == sum(1 for b in free if self.kv.pool.blocks[b].block_hash is not None)
        for rid, req in self.live.items():
            assert len(self.kv.blocks_of(rid)) == self.kv.blocks_needed(req.num_computed_tokens)
        used_cpu = sum(len(self.cpu.blocks_of(r)) for r in self.swapped)
        assert used_cpu + self.cpu.num_free_blocks == self.cpu.num_blocks

    def teardown(self):
        for req in self.live.values():
            self.kv.free(req)
        for rid in self.swapped:
            self.cpu.release(rid)
        self.kv.check_invariants()
        assert self.kv.num_free_blocks == self.kv.num_blocks        # nothing leaks
        assert self.cpu.num_free_blocks == self.cpu.num_blocks


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_hash_chains_the_parent():
    a = hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert hash_block_tokens(a, [5, 6, 7, 8]) != hash_block_tokens(hash_block_tokens(ROOT_HASH, [9, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3, 4], ("lora-1",)) != a       # extra keys change the hash


def test_freed_cached_blocks_are_reused_then_evicted_lru_deepest_first():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_caching=True, free_queue=LRUFreeBlockQueue)
    first = Request("a", [1, 2, 3, 4, 5], PARAMS, 0, 0.0)
    assert kv.allocate_slots(first, 5)
    a_blocks = kv.blocks_of("a")
    a_hashes = [kv.pool.blocks[b].block_hash for b in a_blocks[:2]]
    kv.free(first)
    assert kv.num_free_blocks == 4 and kv.num_cached_free_blocks == 2  # content kept, still reusable
    again = Request("b", [1, 2, 3, 4, 9], PARAMS, 1, 0.0)
    hits, cached = kv.find_cached_prefix(again)
    assert hits == a_blocks[:2] and cached == 4
    # Reusing the hits takes them out of the free queue (one new block holds the last token) ...
    assert kv.allocate_slots(again, 1, start=cached, cached_blocks=hits)
    assert kv.blocks_of("b")[:2] == a_blocks[:2] and kv.num_free_blocks == 1
    # ... and freeing the request puts them back, their content still cached; the new block is not hashed.
    kv.free(again)
    assert kv.blocks_of("b") == [] and kv.num_free_blocks == 4 and kv.num_cached_free_blocks == 2
    assert kv.stats.evictions == 0
    # New unrelated request needing 3 blocks: the unhashed block goes first, then the deepest cached one.
    other = Request("c", [7, 7, 7, 7, 7, 7], PARAMS, 2, 0.0)
    assert kv.allocate_slots(other, 6)
    assert kv.stats.evictions == 1
    assert kv.pool.hash_to_block.get(a_hashes[0]) == a_blocks[0]  # the shallow block survived
    assert a_hashes[1] not in kv.pool.hash_to_block               # the deeper one was evicted
    kv.check_invariants()
