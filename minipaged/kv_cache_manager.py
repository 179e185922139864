"""The KV cache manager: each request's block table over the block pool, prefix-cache lookups, and swapping
(vLLM v1's ``KVCacheManager`` over its ``BlockPool``).

A request's *block table* lists its blocks in order; token t lives in block ``table[t // block_size]`` at
offset ``t % block_size``. Blocks are handed out on demand, so a request wastes at most the unused tail of its
last block. A request's full blocks are hashed as a chain (``block_pool.hash_block_tokens``) and published
when they are allocated, as in vLLM v1, so that requests admitted in the same step (the ``n`` samples of one
prompt) share them at once. A request frees its blocks tail first, so among blocks freed together the deepest
is evicted first.

Everything that happens here reaches observers through the pool's change log (``block_pool``); this module
keeps the books and nothing for display.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from .block_pool import (ROOT_HASH, BlockChange, BlockHash, BlockPool, Cached, ForwardDone, Looked, Released,
                         SwappedIn, SwappedOut, Taken, hash_block_tokens)
if TYPE_CHECKING:
    from .policies.eviction import FreeBlockQueue
    from .request import Request
    from .swap import CpuBlockPool


@dataclass
class PrefixCacheStats:
    queries: int = 0        # prompt tokens looked up at admission
    hits: int = 0           # of those, tokens found in the cache
    evictions: int = 0      # cached blocks whose content was dropped to make room


class KVCacheManager:
    """Block tables of the running requests over one pool of ``num_blocks`` blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, *,
                 free_queue: type[FreeBlockQueue],         # the eviction policy (vLLM's: LRU), chosen by the builder
                 hash_tokens: Callable[[BlockHash, Sequence[int], tuple], BlockHash] = hash_block_tokens) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, free_queue)
        self.hash_tokens = hash_tokens  # a block's hash from its parent's and its tokens (lab 2 swaps in its own)
        self.req_blocks: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}  # hashes of the request's full blocks, in order
        self.req_num_hashed: dict[str, int] = {}          # how many of its blocks have been registered
        self._queries = self._hits = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks whose content is still a cache hit (O(1): the pool keeps the count)."""
        return self.pool.num_cached_free

    @property
    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._queries, self._hits, self.pool.num_evictions)

    def take_log(self) -> list[BlockChange]:
        """The pool's changes since the last call (for observers, once a step)."""
        return self.pool.take_log()

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

        If every token is cached we still recompute the last one: its logits are needed to sample. The lookup
        goes into the log (``Looked``) with what an observer needs to explain where it stopped.
        """
        if not self.enable_caching:
            return [], 0
        hits: list[int] = []
        bs = self.block_size
        hashes = self._block_hashes(req, req.num_tokens // bs)
        for h in hashes:
            block_id = self.pool.hash_to_block.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        n = len(hits)
        missed = tuple(req.token_ids_between(n * bs, (n + 1) * bs)) if n < len(hashes) else ()
        self.pool.log.append(Looked(req.request_id, tuple(hashes), n, req_extra_keys(req), missed))
        return hits, min(n * bs, req.num_tokens - 1)

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's lookup. With caching off there was no lookup, so nothing is counted (as vLLM)."""
        if not self.enable_caching:
            return
        self._queries += num_tokens
        self._hits += num_hit_tokens

    # ------------------------------------------------------------------ allocation
    def num_blocks_to_allocate(self, req: Request, num_new_tokens: int, start: int,
                               cached_blocks: Sequence[int] = (), num_lookahead_tokens: int = 0) -> int:
        """Free-queue entries this allocation consumes: new blocks plus cache hits that are now free."""
        have = len(self.req_blocks.get(req.request_id, ())) + len(cached_blocks)
        new_blocks = max(0, self.blocks_needed(start + num_new_tokens + num_lookahead_tokens) - have)
        revived = sum(1 for b in cached_blocks if self.pool.blocks[b].ref_cnt == 0)
        return new_blocks + revived

    def allocate_slots(self, req: Request, num_new_tokens: int, start: Optional[int] = None,
                       cached_blocks: Sequence[int] = (), num_lookahead_tokens: int = 0, num_reserved: int = 0) -> bool:
        """Make room for tokens ``start : start + num_new_tokens`` of the request; False if the pool is short.

        ``cached_blocks`` are prefix-cache hits taken at admission (prefix-aware admission: only the blocks
        beyond them are counted as needed). ``num_lookahead_tokens`` more slots are made for a draft model's
        guesses (speculative decoding), ``num_reserved`` blocks left free. All or nothing: False changes nothing."""
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
                                       num_lookahead_tokens) > self.pool.num_free_blocks - num_reserved:
            return False
        table = self.req_blocks.setdefault(rid, [])
        for block_id in cached_blocks:
            self.pool.touch(block_id)
            table.append(block_id)
            self.pool.log.append(Taken(rid, block_id, True))
        if cached_blocks:
            self.req_num_hashed[rid] = len(table)
        for _ in range(self.blocks_needed(start + num_new_tokens + num_lookahead_tokens) - len(table)):
            block_id = self.pool.take_free_block(rid)
            table.append(block_id)
            self.pool.log.append(Taken(rid, block_id, False))
        if self.enable_caching:
            # Only the request's own tokens: draft tokens may be rejected, so their blocks must not be shared.
            self._register_full_blocks(req, min(start + num_new_tokens, req.num_tokens))
        return True

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
        bs, extra = self.block_size, req_extra_keys(req)
        for i in range(done, num_full):
            if self.pool.cache(table[i], hashes[i]):
                self.pool.log.append(Cached(rid, i, table[i], hashes[i], hashes[i - 1] if i else ROOT_HASH, extra,
                                            tuple(req.token_ids_between(i * bs, (i + 1) * bs))))
        self.req_num_hashed[rid] = num_full

    # ------------------------------------------------------------------ release
    def free(self, req: Request, forget_hashes: bool = True) -> None:
        """Drop the request's hold on its blocks (finish, abort or preemption)."""
        rid = req.request_id
        table = self.req_blocks.pop(rid, [])
        self.req_num_hashed.pop(rid, None)
        if forget_hashes:
            self.req_hashes.pop(rid, None)
        self.pool.release(table[::-1])                 # tail first: deeper blocks are evicted first
        if table:
            self.pool.log.append(Released(rid, tuple(table)))

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (blocks in use keep their content, they just stop being shareable)."""
        dropped = self.pool.reset_hashes()
        for rid, table in self.req_blocks.items():
            self.req_num_hashed[rid] = len(table)       # never re-publish what was just forgotten
        return len(dropped)

    def mark_forward_done(self) -> None:
        """The step's forward pass is over: frees from now on are requests that finished after it (observers
        apply them after the step's allocations, since a block can be taken and let go within one step)."""
        self.pool.log.append(ForwardDone())

    # ------------------------------------------------------------------ swapping
    def swap_out(self, req: Request, cpu_pool: CpuBlockPool) -> Optional[list[tuple[int, int]]]:
        """Give the request's device blocks up, with a CPU block per block to copy into; None if CPU is full."""
        table = self.req_blocks.get(req.request_id, [])
        cpu_blocks = cpu_pool.allocate(req.request_id, len(table))
        if cpu_blocks is None:
            return None
        mapping = list(zip(table, cpu_blocks))
        self.free(req, forget_hashes=False)
        self.pool.log.append(SwappedOut(req.request_id, tuple(mapping)))
        return mapping

    def can_swap_in(self, req: Request, cpu_pool: CpuBlockPool, num_reserved: int = 0) -> bool:
        """Room for the swapped blocks and for the next token's slot (a new block only if the last is full), with
        ``num_reserved`` blocks left free. Never more than the request needs: one that held the whole pool comes back.
        """
        need = max(len(cpu_pool.blocks_of(req.request_id)), self.blocks_needed(req.num_computed_tokens + 1))
        return need <= self.pool.num_free_blocks - num_reserved

    def swap_in(self, req: Request, cpu_pool: CpuBlockPool) -> list[tuple[int, int]]:
        cpu_blocks = cpu_pool.release(req.request_id)
        table = [self.pool.take_free_block(req.request_id) for _ in cpu_blocks]
        self.req_blocks[req.request_id] = table
        self.req_num_hashed[req.request_id] = 0
        mapping = list(zip(cpu_blocks, table))
        self.pool.log.append(SwappedIn(req.request_id, tuple(mapping)))
        if self.enable_caching:
            self._register_full_blocks(req, req.num_computed_tokens)
        return mapping

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Raise AssertionError if the books do not balance (used by the property tests)."""
        refs = [0] * self.num_blocks
        for table in self.req_blocks.values():
            for b in table:
                refs[b] += 1
        self.pool.check_invariants(refs)


def req_extra_keys(req: Request) -> tuple:
    """Extra inputs that change a block's KV for the same tokens. None yet: the hook for LoRA/multimodal."""
    return ()
