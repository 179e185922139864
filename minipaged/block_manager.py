"""The KV block pool: who owns which block, and which blocks hold a reusable prefix.

The KV cache is a fixed pool of blocks of ``block_size`` token slots. A request's *block table* lists its
blocks in order; token t lives in block ``table[t // block_size]`` at offset ``t % block_size``. Blocks are
handed out on demand, one at a time, so a request wastes at most the unused tail of its last block.

Automatic prefix caching: a *full* block gets a hash that chains its parent's hash with its own token ids
(and any extra keys), so equal hashes mean equal prefixes. A map from hash to block lets a new request
reuse blocks another request computed. Blocks carry reference counts; shared blocks are read-only.

A block whose ref count drops to 0 goes back to the free queue but keeps its hash and content: until the
pool needs it, it is still a cache hit. The queue's order is the eviction policy (``minipaged.policies``):
vLLM's LRU takes the blocks freed longest ago first; a request frees its blocks tail first, so among blocks
freed together the deepest goes first. Blocks with no hash hold nothing reusable, so they go to the *front*
of the queue and are reused first.

Every admission's lookup is explained (``explain_lookup``): how many blocks hit, and why the first miss
missed (never computed, evicted at step S for request R, or its tokens differ from the cached ones from
position P), from a small bounded record of evictions and cached blocks (minipaged/prefix_misses.py).

The pool keeps its counts (free, cached and free) as it goes, so every step's event reads them in O(1).

Every change is written straight into ``changes``, the ``events.KVChanges`` that the step's StepEvent
carries; the engine takes it (``drain_changes``) once per step.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from .events import KVChanges, PrefixLookup
from .kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from .policies.eviction import FreeBlockQueue, LRUFreeBlockQueue
from .prefix_misses import MissRecord
from .request import Request

BlockHash = bytes
ROOT_HASH: BlockHash = b""  # the parent hash of a request's first block


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """Hash of one full block: depends on everything before it (via the parent) and its own tokens.

    ``extra_keys`` is the hook for anything else that changes a block's KV for the same tokens (a LoRA
    adapter, an image id, a cache salt). SHA-256, as in vLLM since CVE-2025-25183: a hit is trusted without
    comparing tokens, so two prefixes whose hashes collided would silently share KV. Python's 64-bit
    ``hash()`` makes collisions findable on purpose and is salted per process for strings.
    """
    payload = repr((list(token_ids), extra_keys)).encode()
    return hashlib.sha256(parent_hash + payload).digest()


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[BlockHash] = None


@dataclass
class PrefixCacheStats:
    queries: int = 0        # prompt tokens looked up at admission
    hits: int = 0           # of those, tokens found in the cache
    evictions: int = 0      # cached blocks whose content was dropped to make room


class KVCacheManager:
    """Block tables of the running requests over one pool of ``num_blocks`` blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 free_queue: type[FreeBlockQueue] = LRUFreeBlockQueue,
                 hash_tokens: Callable[[BlockHash, Sequence[int], tuple], BlockHash] = hash_block_tokens) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: FreeBlockQueue = free_queue(range(num_blocks))
        self._num_cached_free = 0     # free blocks that still hold a hash: kept as blocks move, never counted
        self.hash_tokens = hash_tokens  # a block's hash from its parent's and its tokens (lab 2 swaps in its own)
        self.hash_to_block: dict[BlockHash, int] = {}
        self.req_blocks: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}  # hashes of the request's full blocks, in order
        self.req_num_hashed: dict[str, int] = {}          # how many of its blocks have been registered
        self.stats = PrefixCacheStats()
        self.changes = KVChanges()
        self.forward_done = False     # frees from now on happened after this step's forward pass
        self.kv_events: Optional[list[KVCacheEvent]] = None   # a list: record vLLM's KV events (kv_events.py)
        self.step = 1                 # the engine step under way: drain_changes (once a step) counts them
        self.misses = MissRecord(num_blocks)     # evidence for explain_lookup

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Free blocks, counting cached-but-free ones: they can be taken at any time."""
        return len(self.free_queue)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks whose content is still a cache hit (O(1): the count is kept, see check_invariants)."""
        return self._num_cached_free

    def blocks_of(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_hashes(self, req: Request, num_full_blocks: int) -> list[BlockHash]:
        """Hashes of the request's first ``num_full_blocks`` blocks, computed once and extended lazily."""
        hashes = self.req_hashes.setdefault(req.request_id, [])
        if len(hashes) < num_full_blocks:
            bs = self.block_size
            parent = hashes[-1] if hashes else ROOT_HASH
            for i in range(len(hashes), num_full_blocks):
                parent = self.hash_tokens(parent, req.token_ids_between(i * bs, (i + 1) * bs), req_extra_keys(req))
                hashes.append(parent)
        return hashes[:num_full_blocks]

    def find_cached_prefix(self, req: Request) -> tuple[list[int], int]:
        """Blocks holding the longest cached prefix of the request, and how many tokens need no compute.

        If every token is cached we still recompute the last one: its logits are needed to sample.
        """
        if not self.enable_caching:
            return [], 0
        hits: list[int] = []
        for h in self._block_hashes(req, req.num_tokens // self.block_size):
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, min(len(hits) * self.block_size, req.num_tokens - 1)

    def explain_lookup(self, req: Request, num_hit_blocks: int) -> PrefixLookup:
        """Why ``find_cached_prefix`` found only ``num_hit_blocks`` blocks of the request: call it before the
        request's own allocation publishes its blocks (its own hashes would then be found)."""
        bs = self.block_size
        hashes = self._block_hashes(req, req.num_tokens // bs)
        parent = hashes[num_hit_blocks - 1] if num_hit_blocks else ROOT_HASH
        missed = req.token_ids_between(num_hit_blocks * bs, (num_hit_blocks + 1) * bs) \
            if num_hit_blocks < len(hashes) else []
        return self.misses.explain(hashes, num_hit_blocks, parent, req_extra_keys(req), missed, bs)

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's lookup. With caching off there was no lookup, so nothing is counted (as vLLM)."""
        if not self.enable_caching:
            return
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    # ------------------------------------------------------------------ allocation
    def num_blocks_to_allocate(self, req: Request, num_new_tokens: int, start: int,
                               cached_blocks: Sequence[int] = (), num_lookahead_tokens: int = 0) -> int:
        """Free-queue entries this allocation consumes: new blocks plus cache hits that are now free."""
        have = len(self.req_blocks.get(req.request_id, ())) + len(cached_blocks)
        new_blocks = max(0, self.blocks_needed(start + num_new_tokens + num_lookahead_tokens) - have)
        revived = sum(1 for b in cached_blocks if self.blocks[b].ref_cnt == 0)
        return new_blocks + revived

    def allocate_slots(self, req: Request, num_new_tokens: int, start: Optional[int] = None,
                       cached_blocks: Sequence[int] = (), num_lookahead_tokens: int = 0) -> bool:
        """Make room for tokens ``start : start + num_new_tokens`` of the request; False if the pool is short.

        ``cached_blocks`` are prefix-cache hits taken at admission (prefix-aware admission: only the blocks
        beyond them are counted as needed). ``num_lookahead_tokens`` more slots are made for a draft model's
        guesses (speculative decoding). All or nothing: on False nothing has changed.
        """
        start = req.num_computed_tokens if start is None else start
        rid = req.request_id
        table = self.req_blocks.get(rid)
        if table is not None and not cached_blocks and \
                start + num_new_tokens + num_lookahead_tokens <= len(table) * self.block_size:
            # The slots exist already (a decode whose last block has room: 15 steps in 16 at block size 16).
            if self.enable_caching:
                self._register_full_blocks(req, min(start + num_new_tokens, req.num_tokens))
            return True
        if self.num_blocks_to_allocate(req, num_new_tokens, start, cached_blocks,
                                       num_lookahead_tokens) > len(self.free_queue):
            return False
        table = self.req_blocks.setdefault(rid, [])
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                self.free_queue.remove(block_id)
                if block.block_hash is not None:
                    self._num_cached_free -= 1
            block.ref_cnt += 1
            table.append(block_id)
        if cached_blocks:
            self.changes.allocated.setdefault(rid, []).extend(cached_blocks)
            self.changes.cache_hits.setdefault(rid, []).extend(cached_blocks)
            self.req_num_hashed[rid] = len(table)
        for _ in range(self.blocks_needed(start + num_new_tokens + num_lookahead_tokens) - len(table)):
            block_id = self._take_free_block(rid)
            table.append(block_id)
            self.changes.allocated.setdefault(rid, []).append(block_id)
        if self.enable_caching:
            # Only the request's own tokens: draft tokens may be rejected, so their blocks must not be shared.
            self._register_full_blocks(req, min(start + num_new_tokens, req.num_tokens))
        return True

    def _take_free_block(self, for_request: str) -> int:
        block_id = self.free_queue.pop_front()
        block = self.blocks[block_id]
        if block.block_hash is not None:                 # reusing a cached block: its prefix is gone
            self._num_cached_free -= 1
            if self.hash_to_block.get(block.block_hash) == block_id:
                del self.hash_to_block[block.block_hash]
                self.misses.dropped(block.block_hash, self.step, for_request)
            if self.kv_events is not None:
                self.kv_events.append(BlockRemoved([block.block_hash]))
            block.block_hash = None
            self.stats.evictions += 1
            self.changes.evicted.append(block_id)
        block.ref_cnt = 1
        return block_id

    def _register_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Publish the hashes of blocks that are full once this step's tokens are computed.

        Publishing at allocation (as vLLM v1 does) lets a request admitted later in the same step share
        them: within each layer the runner writes every new K/V before any attention reads the cache.
        """
        rid = req.request_id
        table = self.req_blocks[rid]
        done = self.req_num_hashed.get(rid, 0)
        num_full = min(num_tokens // self.block_size, len(table))
        if num_full <= done:
            return
        hashes = self._block_hashes(req, num_full)
        stored = []
        bs, extra = self.block_size, req_extra_keys(req)
        for i in range(done, num_full):
            block = self.blocks[table[i]]
            if block.block_hash is None and hashes[i] not in self.hash_to_block:
                block.block_hash = hashes[i]
                self.hash_to_block[hashes[i]] = block.block_id
                self.changes.cached.append(block.block_id)
                stored.append(i)
                self.misses.cached(hashes[i], hashes[i - 1] if i else ROOT_HASH, extra,
                                   req.token_ids_between(i * bs, (i + 1) * bs))
        self.req_num_hashed[rid] = num_full
        if self.kv_events is not None and stored:
            self._record_stored(req, hashes, stored)

    def _record_stored(self, req: Request, hashes: list[BlockHash], stored: list[int]) -> None:
        """One BlockStored per run of consecutive blocks (vLLM sends a request's new blocks together)."""
        bs = self.block_size
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            self.kv_events.append(BlockStored([hashes[i] for i in run], hashes[first - 1] if first else None,
                                              list(req.token_ids_between(first * bs, (last + 1) * bs)), bs))

    # ------------------------------------------------------------------ release
    def free(self, req: Request, forget_hashes: bool = True) -> None:
        """Drop the request's hold on its blocks (finish, abort or preemption)."""
        rid = req.request_id
        table = self.req_blocks.pop(rid, [])
        self.req_num_hashed.pop(rid, None)
        if forget_hashes:
            self.req_hashes.pop(rid, None)
        for block_id in reversed(table):               # tail first: deeper blocks are evicted first
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block_id} freed more often than taken"
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self.free_queue.push_back(block_id)
                    self._num_cached_free += 1
                else:
                    self.free_queue.push_front(block_id)
        if table:
            log = self.changes.freed_on_finish if self.forward_done else self.changes.freed
            log.setdefault(rid, []).extend(table)

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (blocks in use keep their content, they just stop being shareable)."""
        dropped = [b.block_id for b in self.blocks if b.block_hash is not None]
        if self.kv_events is not None:
            self.kv_events.append(AllBlocksCleared())
        for block_id in dropped:
            self.misses.dropped(self.blocks[block_id].block_hash, self.step, None)
            self.blocks[block_id].block_hash = None
        self.hash_to_block.clear()
        for rid, table in self.req_blocks.items():
            self.req_num_hashed[rid] = len(table)       # never re-publish what was just forgotten
        self.changes.uncached.extend(dropped)
        self._num_cached_free = 0                        # no block holds a hash any more
        # Unhashed free blocks belong at the front; order among them does not matter.
        return len(dropped)

    # ------------------------------------------------------------------ swapping
    def swap_out(self, req: Request, cpu_pool: "CpuBlockPool") -> Optional[list[tuple[int, int]]]:
        """Give the request's GPU blocks up, with a CPU block per GPU block to copy into; None if CPU is full."""
        table = self.req_blocks.get(req.request_id, [])
        cpu_blocks = cpu_pool.allocate(req.request_id, len(table))
        if cpu_blocks is None:
            return None
        mapping = list(zip(table, cpu_blocks))
        self.free(req, forget_hashes=False)
        self.changes.swapped_out[req.request_id] = mapping
        return mapping

    def can_swap_in(self, req: Request, cpu_pool: "CpuBlockPool") -> bool:
        """Room for the swapped blocks and for the next token's slot (a new block only if the last is full).

        Never more than the request needs, so a request that once held the whole pool can come back.
        """
        need = max(len(cpu_pool.blocks_of(req.request_id)), self.blocks_needed(req.num_computed_tokens + 1))
        return need <= len(self.free_queue)

    def swap_in(self, req: Request, cpu_pool: "CpuBlockPool") -> list[tuple[int, int]]:
        cpu_blocks = cpu_pool.release(req.request_id)
        table = [self._take_free_block(req.request_id) for _ in cpu_blocks]
        self.req_blocks[req.request_id] = table
        self.req_num_hashed[req.request_id] = 0
        if self.enable_caching:
            self._register_full_blocks(req, req.num_computed_tokens)
        mapping = list(zip(cpu_blocks, table))
        self.changes.swapped_in[req.request_id] = mapping
        return mapping

    # ------------------------------------------------------------------ events and checks
    def mark_forward_done(self) -> None:
        """From now until the next drain, freed blocks belong to requests that finished after the forward
        pass. The event lists them apart (``freed_on_finish``): an observer applies them after the step's
        allocations, since a block can be taken and let go within one step."""
        self.forward_done = True

    def drain_changes(self) -> KVChanges:
        """Everything that happened to blocks since the last drain; called once per step, for its event."""
        changes, self.changes = self.changes, KVChanges()
        self.forward_done = False
        self.step += 1
        return changes

    def check_invariants(self) -> None:
        """Raise AssertionError if the books do not balance (used by the property tests)."""
        refs = [0] * self.num_blocks
        for table in self.req_blocks.values():
            for b in table:
                refs[b] += 1
        free = set(self.free_queue)         # the queue's own interface: __iter__, not a helper
        assert len(free) == len(self.free_queue), "a block is queued twice"
        for block in self.blocks:
            assert block.ref_cnt == refs[block.block_id], f"block {block.block_id}: ref count disagrees"
            assert block.ref_cnt >= 0
            assert (block.block_id in free) == (block.ref_cnt == 0), f"block {block.block_id}: free xor used"
            if block.block_hash is not None:
                assert self.hash_to_block.get(block.block_hash) == block.block_id, "hash map disagrees"
        for h, b in self.hash_to_block.items():
            assert self.blocks[b].block_hash == h, "hash map points at a block with another hash"
        self.misses.check(self.hash_to_block.keys())
        assert len(free) + sum(1 for r in refs if r > 0) == self.num_blocks, "free + used != total"
        recount = sum(1 for b in free if self.blocks[b].block_hash is not None)
        assert self._num_cached_free == recount, f"kept cached-free count {self._num_cached_free} != recount {recount}"


def req_extra_keys(req: Request) -> tuple:
    """Extra inputs that change a block's KV for the same tokens. None yet: the hook for LoRA/multimodal."""
    return ()


class CpuBlockPool:
    """Blocks in host memory that hold swapped-out requests (no caching: a plain free list)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._owned: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, request_id: str, n: int) -> Optional[list[int]]:
        if n > len(self._free):
            return None
        blocks = [self._free.pop() for _ in range(n)]
        self._owned[request_id] = blocks
        return blocks

    def blocks_of(self, request_id: str) -> list[int]:
        return self._owned.get(request_id, [])

    def release(self, request_id: str) -> list[int]:
        blocks = self._owned.pop(request_id, [])
        self._free.extend(reversed(blocks))
        return blocks
