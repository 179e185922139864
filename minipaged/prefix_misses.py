"""Why a prompt's prefix-cache lookup stopped where it did: the small record the block manager keeps for it.

A lookup walks the request's block hashes until one is not cached. That block missed for one of three
reasons, and each needs its own evidence, kept as blocks gain and lose their hashes:

* **evicted**: a bounded LRU map ``hash -> (step, request)`` of hashes whose block was taken for another
  request (or dropped by a cache reset). It holds at most ``max(MIN_EVICTIONS_KEPT, num_blocks)`` entries
  (about 250 bytes each: 1 MB at the minimum); a hash leaves it when the oldest entry must make room, or when
  it is cached again.
* **tokens differ**: every *cached* block is filed under its parent's hash (and extra keys), its token ids
  kept in one sorted list per parent. The blocks that could have continued the request's cached chain are
  exactly the cached children of its last hit, so the longest cached chain the prompt shares ends inside
  one of them. In lexicographic order the list entry sharing the longest prefix with the prompt's block is
  a neighbour of the block's insertion point: one ``bisect`` and two comparisons of ``block_size`` tokens,
  whatever the number of children. Memory: ``block_size`` ints per cached block, at most the pool's size.
* **never computed**: neither of the above, and the eviction record never had to forget an entry, so no
  block has ever held that hash. Once it has forgotten one, such a miss is "unrecorded" instead: the
  record cannot tell "never" from "long ago", and says so rather than guess.

The engine thread pays on the hot path only a tuple, an ``insort`` and a dict write per block that gets a
hash (one every ``block_size`` tokens), and a ``bisect`` removal per evicted block; the explanation itself
is built once per admission. Inserting and removing move up to k list entries, k being the cached blocks
with the same parent: a handful inside a shared prefix, and one per distinct first block at the root.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from collections import OrderedDict
from typing import Iterable, Optional, Sequence

from .events import PrefixLookup

MIN_EVICTIONS_KEPT = 4096

BlockHash = bytes
SiblingKey = tuple[BlockHash, tuple]     # (parent's hash, extra keys): blocks that could follow the same chain


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class MissRecord:
    """The evidence ``explain`` reads: recent evictions, and the token ids of cached blocks by parent."""

    def __init__(self, num_blocks: int) -> None:
        self.capacity = max(MIN_EVICTIONS_KEPT, num_blocks)
        self.evictions: OrderedDict[BlockHash, tuple[int, Optional[str]]] = OrderedDict()
        self.forgot_an_eviction = False      # once True, "never computed" can no longer be proven
        self._children: dict[SiblingKey, list[tuple[int, ...]]] = {}
        self._cached: dict[BlockHash, tuple[SiblingKey, tuple[int, ...]]] = {}

    def cached(self, block_hash: BlockHash, parent: BlockHash, extra_keys: tuple, token_ids: Sequence[int]) -> None:
        """A block got ``block_hash``: it is now a possible continuation of ``parent``'s chain."""
        key, tokens = (parent, extra_keys), tuple(token_ids)
        self._cached[block_hash] = (key, tokens)
        insort(self._children.setdefault(key, []), tokens)
        self.evictions.pop(block_hash, None)

    def dropped(self, block_hash: BlockHash, step: int, request_id: Optional[str]) -> None:
        """``block_hash`` left the cache at ``step``: taken for ``request_id``'s allocation (None: a reset)."""
        entry = self._cached.pop(block_hash, None)
        if entry is not None:
            key, tokens = entry
            siblings = self._children[key]
            del siblings[bisect_left(siblings, tokens)]
            if not siblings:
                del self._children[key]
        self.evictions[block_hash] = (step, request_id)
        self.evictions.move_to_end(block_hash)
        if len(self.evictions) > self.capacity:
            self.evictions.popitem(last=False)
            self.forgot_an_eviction = True

    def check(self, cached_hashes: Iterable[BlockHash]) -> None:
        """Raise AssertionError unless the record files exactly the cached hashes (the property tests' check)."""
        assert set(self._cached) == set(cached_hashes), "the miss record's cached blocks disagree with the pool"
        assert sum(map(len, self._children.values())) == len(self._cached), "a cached block is filed twice"
        assert not set(self.evictions) & set(self._cached), "a cached hash is also recorded as evicted"
        assert len(self.evictions) <= self.capacity

    def explain(self, hashes: Sequence[BlockHash], num_hits: int, parent: BlockHash, extra_keys: tuple,
                missed_tokens: Sequence[int], block_size: int) -> PrefixLookup:
        """Why block ``num_hits`` of a request whose full blocks have ``hashes`` missed (``parent``: the hash
        before it; ``missed_tokens``: its token ids)."""
        n = len(hashes)
        if num_hits >= n:
            return PrefixLookup(n, n, "all_hit")
        evicted = self.evictions.get(hashes[num_hits])
        if evicted is not None:
            step, rid = evicted
            return PrefixLookup(n, num_hits, "evicted" if rid is not None else "reset", step, rid)
        siblings = self._children.get((parent, extra_keys), ())
        if siblings:
            tokens = tuple(missed_tokens)
            i = bisect_left(siblings, tokens)
            shared = max(common_prefix(tokens, siblings[j]) for j in (i - 1, i) if 0 <= j < len(siblings))
            position = num_hits * block_size + shared
            if position > 0:               # sharing nothing with any cached first block is "never", not "differs"
                return PrefixLookup(n, num_hits, "differs", differs_at=position)
        return PrefixLookup(n, num_hits, "unrecorded" if self.forgot_an_eviction else "never")
