"""An observer of the KV cache: it reads the block pool's change log once a step and derives what watchers
are shown of it, outside the engine core (which does not know this module exists).

From the one log (``block_pool``: ``Taken``, ``Cached``, ``Evicted``, ``Released`` ...), in order:
  * the step event's ``KVChanges`` (which blocks each request got, which got hashes, were evicted, freed);
  * vLLM's KV cache events (``kv_events``: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), kept
    only while a publisher asks for them (``kv_events`` is a list, not None: ``serve --kv-events-config``);
  * why each admission's prefix-cache lookup stopped where it did (``PrefixLookup``), from a bounded record
    of evictions and cached blocks (``prefix_misses.MissRecord``). The log is read in order, so each lookup
    is explained against the cache exactly as it was when the scheduler looked.
"""
from __future__ import annotations

from typing import Optional

from .block_pool import (ROOT_HASH, BlockChange, Cached, CacheReset, Evicted, ForwardDone, Looked, Released,
                         SwappedIn, SwappedOut, Taken)
from .events import KVChanges, PrefixLookup
from .kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from .prefix_misses import MissRecord


class KVRecorder:
    """Folds the block pool's change log, step by step, into block changes, KV events and miss explanations."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.misses = MissRecord(num_blocks)
        self.kv_events: Optional[list[KVCacheEvent]] = None   # a list: record vLLM's KV events (kv_events.py)
        self.step = 1                 # the engine step whose changes are being read (an eviction's "when")
        # Each looked-up request's latest lookup, explained, until the event of the step that admitted it takes
        # it: with async output processing that event is built a step after the lookup was logged.
        self.lookups: dict[str, PrefixLookup] = {}

    def fold(self, log: list[BlockChange]) -> tuple[KVChanges, dict[str, PrefixLookup]]:
        """One step's changes: its ``KVChanges``, and the lookups not yet taken (``lookups``), this step's
        explained and added."""
        changes = KVChanges()
        lookups = self.lookups
        forward_done = False
        stored: list[Cached] = []          # a run of blocks one request published together (one BlockStored)
        for entry in log:
            kind = type(entry)
            if kind is not Cached and stored:
                self._store(stored)
            if kind is Taken:
                changes.allocated.setdefault(entry.request_id, []).append(entry.block_id)
                if entry.hit:
                    changes.cache_hits.setdefault(entry.request_id, []).append(entry.block_id)
            elif kind is Cached:
                changes.cached.append(entry.block_id)
                self.misses.cached(entry.block_hash, entry.parent_hash, entry.extra_keys, entry.token_ids)
                if stored and (stored[-1].request_id != entry.request_id or stored[-1].index != entry.index - 1):
                    self._store(stored)
                stored.append(entry)
            elif kind is Evicted:
                changes.evicted.append(entry.block_id)
                self.misses.dropped(entry.block_hash, self.step, entry.for_request)
                if self.kv_events is not None:
                    self.kv_events.append(BlockRemoved([entry.block_hash]))
            elif kind is Released:
                target = changes.freed_on_finish if forward_done else changes.freed
                target.setdefault(entry.request_id, []).extend(entry.block_ids)
            elif kind is CacheReset:
                changes.uncached.extend(entry.block_ids)
                for block_hash in entry.block_hashes:
                    self.misses.dropped(block_hash, self.step, None)
                if self.kv_events is not None:
                    self.kv_events.append(AllBlocksCleared())
            elif kind is SwappedOut:
                changes.swapped_out[entry.request_id] = list(entry.mapping)
            elif kind is SwappedIn:
                changes.swapped_in[entry.request_id] = list(entry.mapping)
            elif kind is Looked:
                lookups[entry.request_id] = self._explain(entry)
            elif kind is ForwardDone:
                forward_done = True
        if stored:
            self._store(stored)
        self.step += 1
        return changes, lookups

    def _explain(self, looked: Looked) -> PrefixLookup:
        hashes, n = looked.block_hashes, looked.num_hits
        parent = hashes[n - 1] if n else ROOT_HASH
        return self.misses.explain(hashes, n, parent, looked.extra_keys, looked.missed_tokens, self.block_size)

    def _store(self, run: list[Cached]) -> None:
        """One BlockStored per run of consecutive blocks of one request (vLLM sends them together)."""
        if self.kv_events is not None:
            first = run[0]
            self.kv_events.append(BlockStored([c.block_hash for c in run],
                                              first.parent_hash if first.index else None,
                                              [t for c in run for t in c.token_ids], self.block_size))
        run.clear()
