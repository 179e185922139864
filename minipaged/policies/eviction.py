"""Free-block eviction: the order in which free blocks are handed out again (``--eviction-policy``).

A block whose last user lets go keeps its content and its prefix-cache hash until the pool hands it out
again: until then it is still a cache hit. So the order of the free queue *is* the eviction policy.
The block manager tells the queue two kinds of frees apart:

  * ``push_front``: a block with no hash holds nothing reusable; hand it out before any cached block.
  * ``push_back``: a block that holds a cached prefix; the policy decides when it is given up.

and calls ``pop_front`` to take a block, ``remove`` when a free cached block becomes a cache hit. Every call
is O(1): the queue is touched for every block of every request.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Iterable, Iterator


class FreeBlockQueue(ABC):
    """Free block ids; ``pop_front`` returns the one to hand out (evict) next."""

    name = "custom"

    def __init__(self, block_ids: Iterable[int]) -> None:
        """All of ``block_ids`` start free and uncached (the order they come in is the order to use them)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, block_id: int) -> bool: ...

    @abstractmethod
    def pop_front(self) -> int:
        """Take the next block to hand out (the queue is never empty when this is called)."""

    @abstractmethod
    def push_back(self, block_id: int) -> None:
        """A freed block that holds a cached prefix."""

    @abstractmethod
    def push_front(self, block_id: int) -> None:
        """A freed block with nothing reusable in it: hand it out before any cached block."""

    @abstractmethod
    def remove(self, block_id: int) -> None:
        """A free cached block became a cache hit: it is in use again."""

    @abstractmethod
    def __iter__(self) -> Iterator[int]:
        """Every free block id, in the order they would be handed out (checks and pictures only: O(n))."""


class LRUFreeBlockQueue(FreeBlockQueue):
    """vLLM's: the block freed longest ago is evicted first (one ordered dict: O(1) at both ends and inside)."""

    name = "lru"

    def __init__(self, block_ids: Iterable[int]) -> None:
        self._queue: OrderedDict[int, None] = OrderedDict((b, None) for b in block_ids)

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._queue

    def __iter__(self) -> Iterator[int]:
        return iter(self._queue)

    def pop_front(self) -> int:
        block_id, _ = self._queue.popitem(last=False)
        return block_id

    def push_back(self, block_id: int) -> None:
        self._queue[block_id] = None

    def push_front(self, block_id: int) -> None:
        self._queue[block_id] = None
        self._queue.move_to_end(block_id, last=False)

    def remove(self, block_id: int) -> None:
        del self._queue[block_id]


class MRUFreeBlockQueue(FreeBlockQueue):
    """Hugging Face transformers' continuous batching: the most recently freed cached block is evicted first.

    Uncached blocks still go first. MRU keeps old prefixes and gives up the newest: it wins when requests
    cycle through more prefixes than fit (LRU then evicts each one just before it is needed again).
    """

    name = "mru"

    def __init__(self, block_ids: Iterable[int]) -> None:
        self._uncached: OrderedDict[int, None] = OrderedDict((b, None) for b in block_ids)
        self._cached: OrderedDict[int, None] = OrderedDict()     # oldest free first; the last one goes first

    def __len__(self) -> int:
        return len(self._uncached) + len(self._cached)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._uncached or block_id in self._cached

    def __iter__(self) -> Iterator[int]:
        yield from self._uncached
        yield from reversed(self._cached)

    def pop_front(self) -> int:
        if self._uncached:
            return self._uncached.popitem(last=False)[0]
        return self._cached.popitem(last=True)[0]

    def push_back(self, block_id: int) -> None:
        self._cached[block_id] = None

    def push_front(self, block_id: int) -> None:
        self._uncached[block_id] = None
        self._uncached.move_to_end(block_id, last=False)

    def remove(self, block_id: int) -> None:
        if block_id in self._uncached:
            del self._uncached[block_id]
        else:
            del self._cached[block_id]
