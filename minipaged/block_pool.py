"""The block pool: every KV block, the free-block queue, which blocks hold a reusable prefix, and one
append-only log of what happened to them (vLLM v1's ``BlockPool``).

The KV cache is a fixed pool of blocks of ``block_size`` token slots. Blocks carry reference counts; a block
whose count drops to 0 goes back to the free queue but keeps its hash and content: until the pool needs it,
it is still a cache hit. The queue's order is the eviction policy (``minipaged.policies``): vLLM's LRU takes
the blocks freed longest ago first. Blocks with no hash hold nothing reusable, so they go to the *front* of
the queue and are reused first. The pool keeps its counts (free, cached and free) as it goes, so every
step reads them in O(1).

Automatic prefix caching: a *full* block gets a hash that chains its parent's hash with its own token ids
(and any extra keys), so equal hashes mean equal prefixes; ``hash_to_block`` lets a new request reuse blocks
another request computed.

**The change log.** Every change is appended to ``log`` as a small plain record (below) and nothing else: the
pool does not know who watches. Observers (``minipaged.kv_recorder``: the step event's block changes, vLLM's
KV cache events, the explanations of prefix-cache misses) fold the log once a step, outside the core. One
log, written by the pool and the KV cache manager above it (nobody else), in the order things happened: that
order is what lets an observer rebuild the block map.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence, Union

if TYPE_CHECKING:
    from .policies.eviction import FreeBlockQueue

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


# ---------------------------------------------------------------------- the change log's records
class Taken(NamedTuple):
    """``block_id`` was appended to ``request_id``'s block table: a new block, or a cache ``hit``."""
    request_id: str
    block_id: int
    hit: bool


class Cached(NamedTuple):
    """``block_id`` (block ``index`` of ``request_id``) got ``block_hash``: its prefix can now be shared."""
    request_id: str
    index: int
    block_id: int
    block_hash: BlockHash
    parent_hash: BlockHash
    extra_keys: tuple
    token_ids: tuple[int, ...]


class Evicted(NamedTuple):
    """A free cached block was taken for ``for_request``: its hash (its prefix) is gone."""
    block_id: int
    block_hash: BlockHash
    for_request: str


class Released(NamedTuple):
    """A request let its blocks go (finish, abort, preemption, swap-out), in the order it held them."""
    request_id: str
    block_ids: tuple[int, ...]


class CacheReset(NamedTuple):
    """``reset_prefix_cache``: these blocks lost their hashes."""
    block_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]


class SwappedOut(NamedTuple):
    request_id: str
    mapping: tuple[tuple[int, int], ...]      # (device block, CPU block)


class SwappedIn(NamedTuple):
    request_id: str
    mapping: tuple[tuple[int, int], ...]      # (CPU block, device block)


class Looked(NamedTuple):
    """A prefix-cache lookup at admission: the request's full-block hashes and how many hit (and the tokens of
    the first block that missed), so that an observer can explain the miss against the cache as it was."""
    request_id: str
    block_hashes: tuple[BlockHash, ...]
    num_hits: int
    extra_keys: tuple
    missed_tokens: tuple[int, ...]


class ForwardDone(NamedTuple):
    """The step's forward pass is over: blocks released from here on belong to requests that finished after it."""


BlockChange = Union[Taken, Cached, Evicted, Released, CacheReset, SwappedOut, SwappedIn, Looked, ForwardDone]


class BlockPool:
    """``num_blocks`` blocks, their free queue and the hash map; every change is appended to ``log``."""

    def __init__(self, num_blocks: int, free_queue: type[FreeBlockQueue]) -> None:
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: FreeBlockQueue = free_queue(range(num_blocks))
        self.hash_to_block: dict[BlockHash, int] = {}
        self.num_cached_free = 0       # free blocks that still hold a hash: kept as blocks move, never counted
        self.num_evictions = 0         # cached blocks whose content was dropped to make room
        self.log: list[BlockChange] = []

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, counting cached-but-free ones: they can be taken at any time."""
        return len(self.free_queue)

    def take_log(self) -> list[BlockChange]:
        """The changes since the last call (an observer's once-a-step read)."""
        log, self.log = self.log, []
        return log

    def take_free_block(self, for_request: str) -> int:
        """The free queue's next block, owned once; a cached one loses its hash (an eviction)."""
        block_id = self.free_queue.pop_front()
        block = self.blocks[block_id]
        if block.block_hash is not None:                 # reusing a cached block: its prefix is gone
            self.num_cached_free -= 1
            if self.hash_to_block.get(block.block_hash) == block_id:
                del self.hash_to_block[block.block_hash]
            self.log.append(Evicted(block_id, block.block_hash, for_request))
            block.block_hash = None
            self.num_evictions += 1
        block.ref_cnt = 1
        return block_id

    def touch(self, block_id: int) -> None:
        """One more holder of a cached block (a prefix-cache hit); a free one leaves the free queue."""
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            self.free_queue.remove(block_id)
            if block.block_hash is not None:
                self.num_cached_free -= 1
        block.ref_cnt += 1

    def cache(self, block_id: int, block_hash: BlockHash) -> bool:
        """Give a full block its hash, unless it has one or another block already holds that prefix."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self.hash_to_block:
            return False
        block.block_hash = block_hash
        self.hash_to_block[block_hash] = block_id
        return True

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one hold on each block, in the order given (tail first: deeper blocks are evicted first)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block_id} freed more often than taken"
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self.free_queue.push_back(block_id)
                    self.num_cached_free += 1
                else:
                    self.free_queue.push_front(block_id)

    def reset_hashes(self) -> list[int]:
        """Forget every hash (blocks in use keep their content, they just stop being shareable)."""
        dropped = [b.block_id for b in self.blocks if b.block_hash is not None]
        self.log.append(CacheReset(tuple(dropped), tuple(self.blocks[b].block_hash for b in dropped)))
        for block_id in dropped:
            self.blocks[block_id].block_hash = None
        self.hash_to_block.clear()
        self.num_cached_free = 0                         # no block holds a hash any more
        return dropped

    def check_invariants(self, refs: list[int]) -> None:
        """Raise AssertionError unless the books balance, given each block's holders counted from the tables."""
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
        assert len(free) + sum(1 for r in refs if r > 0) == self.num_blocks, "free + used != total"
        recount = sum(1 for b in free if self.blocks[b].block_hash is not None)
        assert self.num_cached_free == recount, f"kept cached-free count {self.num_cached_free} != recount {recount}"
