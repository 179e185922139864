"""Lab 1: the LRU free-block queue, the order in which the prefix cache forgets.

The student writes ``LRUQueue``, the free-block queue of ``minipaged.policies.eviction`` (the engine's own is
``LRUFreeBlockQueue``). The checks drive it alone, then inside the engine's real ``KVCacheManager``.
"""
from __future__ import annotations

import random
import time
from typing import Any

from minipaged.kv_cache_manager import KVCacheManager
from minipaged.policies import LRUFreeBlockQueue
from minipaged.request import Request, SamplingParams

from .core import Lab, LabFailure, expect

STUB = '''"""Lab 1: the LRU free-block queue. Fill in the TODOs, then run `minipaged lab check 1`.

The KV pool hands out free blocks from the front of this queue. A freed block that holds a cached prefix
keeps its content until it is handed out again, so the queue's order decides which prefix is forgotten
first. vLLM forgets the Least Recently Used: the block freed longest ago. Every method must be O(1):
the engine calls them for every block of every request.
"""
from collections import OrderedDict


class LRUQueue:
    def __init__(self, block_ids):
        """All of block_ids start free (and empty), handed out in the order given."""
        self._queue = OrderedDict()        # block id -> None; its order is the queue's order
        # TODO: put every block id in the queue, in order.
        raise NotImplementedError("LRUQueue.__init__")

    def __len__(self):
        return len(self._queue)

    def __contains__(self, block_id):
        return block_id in self._queue

    def __iter__(self):
        """The free block ids in the order they would be handed out."""
        return iter(self._queue)

    def pop_front(self):
        """Take the block to hand out next (the queue is never empty when this is called)."""
        # TODO
        raise NotImplementedError("LRUQueue.pop_front")

    def push_back(self, block_id):
        """A freed block that holds a cached prefix: the last to be handed out, for now."""
        # TODO
        raise NotImplementedError("LRUQueue.push_back")

    def push_front(self, block_id):
        """A freed block with nothing reusable in it: hand it out before any cached block."""
        # TODO
        raise NotImplementedError("LRUQueue.push_front")

    def remove(self, block_id):
        """A free cached block became a cache hit: it leaves the queue, from wherever it is."""
        # TODO
        raise NotImplementedError("LRUQueue.remove")
'''


def fresh_blocks_in_order(cls: Any) -> None:
    """a new queue hands its blocks out in the order given"""
    queue = cls([3, 1, 2])
    expect(len(queue) == 3 and 1 in queue, f"LRUQueue([3, 1, 2]) holds {len(queue)} blocks; it should hold all three.")
    got = [queue.pop_front() for _ in range(3)]
    expect(got == [3, 1, 2], f"a new queue of [3, 1, 2] handed out {got}: at start every block is empty, so the pool "
                             f"just takes them in the order given.")


def least_recently_freed_first(cls: Any) -> None:
    """the cached block freed longest ago is evicted first (LRU, not MRU)"""
    queue = cls([])
    for block in (7, 8, 9):              # freed in this order, all holding cached prefixes
        queue.push_back(block)
    got = [queue.pop_front() for _ in range(3)]
    expect(got != [9, 8, 7], "you evicted 9, 8, 7 after they were freed as 7, 8, 9: that is MRU, the most recently "
                             "freed first (Hugging Face transformers' choice). LRU evicts the block freed longest ago: "
                             "the prefix nobody has asked for in the longest time is the least likely to come back. "
                             "Take from the front, append at the back.")
    expect(got == [7, 8, 9], f"blocks freed as 7, 8, 9 came out as {got}; LRU hands out 7 first, then 8, then 9.")


def empty_blocks_before_cached_ones(cls: Any) -> None:
    """a block with nothing cached is handed out before any cached block"""
    queue = cls([])
    queue.push_back(1)                   # a cached prefix
    queue.push_back(2)
    queue.push_front(5)                  # an empty block, freed last
    got = queue.pop_front()
    expect(got == 5, f"you handed out block {got} while the empty block 5 was free: evicting a cached prefix when "
                     f"an empty block would do throws a cache hit away for nothing. push_front puts it first.")
    expect([queue.pop_front(), queue.pop_front()] == [1, 2], "after the empty block, the cached ones go in LRU order.")


def remove_from_the_middle(cls: Any) -> None:
    """a cache hit takes its block out of the middle of the queue"""
    queue = cls([0, 1, 2, 3])
    queue.remove(2)
    expect(2 not in queue and len(queue) == 3, "after remove(2), block 2 must be gone and three blocks left.")
    expect(list(queue) == [0, 1, 3], f"after remove(2) the queue reads {list(queue)}; the others keep their order.")


def every_operation_is_constant_time(cls: Any) -> None:
    """every operation is O(1): 60 000 of them on a pool of 200 000 blocks take well under a second"""
    n, budget_s = 200_000, 1.0
    queue = cls(range(n))
    victims = random.Random(0).sample(range(n), 20_000)
    operations = [(queue.remove, b) for b in victims] + [(queue.push_back, b) for b in victims]
    start = time.perf_counter()
    for done, (operation, block) in enumerate(operations):
        operation(block)
        if done % 500 == 0 and time.perf_counter() - start > budget_s:
            raise LabFailure(
                f"{done} operations on a queue of {n} blocks took over {budget_s:.0f} s. A list's remove() and pop(0) "
                f"scan or shift the whole list (O(n)); a CUDA pool has over 100 000 blocks and the engine does this "
                f"for every block of every request. An OrderedDict does all of them in O(1).")
    for _ in range(20_000):
        queue.pop_front()
    seconds = time.perf_counter() - start
    expect(seconds < budget_s, f"60 000 operations on a queue of {n} blocks took {seconds:.1f} s. A list's remove() "
                               f"and pop(0) scan or shift the whole list (O(n)); an OrderedDict does them in O(1).")


def inside_the_engine(cls: Any) -> None:
    """inside the engine's KVCacheManager, the books balance and prefixes are shared and evicted LRU"""
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_caching=True, free_queue=cls)
    params = SamplingParams(max_tokens=4)
    rng = random.Random(1)
    live: list[Request] = []
    hit_tokens = 0
    for i in range(200):
        if live and (rng.random() < 0.4 or kv.num_free_blocks < 3):
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            req = Request(f"r{i}", [rng.randrange(3) for _ in range(rng.randint(1, 5))], params, i, 0.0)
            hits, cached = kv.find_cached_prefix(req)
            if kv.allocate_slots(req, req.num_tokens - cached, cached, hits):
                live.append(req)
                hit_tokens += cached
        try:
            kv.check_invariants()
        except AssertionError as e:
            raise LabFailure(f"after {i + 1} operations the pool's books disagree ({e}); does every method "
                             f"keep each free block in the queue exactly once?") from None
    expect(hit_tokens > 0 and kv.stats.evictions > 0,
           "a workload with shared prefixes got no cache hits or no evictions through your queue.")
    evicts_the_least_recently_freed_prefix(cls)


def evicts_the_least_recently_freed_prefix(cls: Any) -> None:
    """Inside the KVCacheManager: A's prefix freed, then B's, then one new block needed: LRU evicts A's, never B's.

    The balanced books above hold for any order, so without this an MRU queue (``popitem()``, last=True) passed
    the engine check while the order check beside it failed: one queue, FAIL and PASS at once."""
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_caching=True, free_queue=cls)
    params = SamplingParams(max_tokens=4)

    def request(name: str, tokens: list[int]) -> Request:
        return Request(name, tokens, params, 0, 0.0)

    for name, tokens in (("A", [1, 2, 3, 4]), ("B", [5, 6, 7, 8])):     # two blocks each, freed A first
        req = request(name, tokens)
        expect(kv.allocate_slots(req, 4, 0), f"the pool of 4 blocks had no room for {name}'s 2 blocks.")
        kv.free(req, forget_hashes=False)
    expect(kv.allocate_slots(request("C", [9, 10]), 2, 0), "the pool had no block left for C (all were free).")
    a_hit = kv.find_cached_prefix(request("A2", [1, 2, 3, 4, 0]))[1]
    b_hit = kv.find_cached_prefix(request("B2", [5, 6, 7, 8, 0]))[1]
    expect(not (b_hit < 4 and a_hit == 4),
           "inside the engine: A's prefix was freed, then B's, then a new request needed one block, and your queue "
           "evicted B's (freed last) while A's stayed cached: that is MRU, the most recently freed first. LRU "
           "evicts the block freed longest ago, A's. Take from the front, append at the back.")
    expect(b_hit == 4 and a_hit == 2,
           f"inside the engine: A's 2-block prefix was freed, then B's, then a new request took one block. LRU "
           f"evicts A's deeper block (a request frees its blocks tail first), so A keeps 2 cached tokens and B 4; "
           f"your queue left A {a_hit} and B {b_hit}. A queue that hands out the block freed last (that is MRU: "
           f"OrderedDict.popitem() takes from the back unless last=False) reuses blocks that were just freed.")


def reference() -> Any:
    return LRUFreeBlockQueue


LAB = Lab(1, "lab1_lru_queue", "The LRU free-block queue", "LRUQueue", STUB, reference,
          (fresh_blocks_in_order, least_recently_freed_first, empty_blocks_before_cached_ones, remove_from_the_middle,
           every_operation_is_constant_time, inside_the_engine),
          watch_options=lambda path: {"eviction_policy": f"{path}:LRUQueue"},
          reference_options={"eviction_policy": "lru"})
