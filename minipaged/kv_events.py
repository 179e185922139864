"""KV cache events as vLLM publishes them: which prefixes a replica's cache gained and lost.

A router that sends each request where its prefix is cached (llm-d's precise prefix-cache scorer, an
indexer built on vLLM's events) has to follow every replica's cache: not guess it from the text it routed,
as sglang-router's ``cache_aware`` does, but be told. vLLM tells it with three events, and so does
minipaged (``minipaged serve --kv-events-config``, ``serve/kv_publisher.py``):

  * ``BlockStored``: full blocks got hashes (their prefix can now be shared), with the parent block's hash,
    their tokens and the block size, so an indexer can hash a new prompt the same way and look it up;
  * ``BlockRemoved``: a cached block was evicted (its prefix is gone);
  * ``AllBlocksCleared``: the whole prefix cache was reset.

The KV recorder (``kv_recorder``) derives them from the block pool's change log when asked to
(``KVRecorder.kv_events`` is a list, not
None); the publisher drains them once per step. Hashes go out as vLLM sends them by default: the last 64
bits of the block's SHA-256, as an unsigned integer. This module is plain data: no torch, no ZMQ.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

MEDIUM = "GPU"       # vLLM's name for the engine's own KV pool (as opposed to an offloading tier); on CPU too


def external_hash(block_hash: bytes) -> int:
    """vLLM's ``maybe_convert_block_hash``: a hash as 64 bits an indexer can store in a uint64."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[bytes]           # consecutive blocks of one request, in order
    parent_block_hash: Optional[bytes]  # the block before the first of them (None: they start the prompt)
    token_ids: list[int]                # every token of those blocks
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[bytes]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


def encode_event(event: KVCacheEvent) -> list[Any]:
    """vLLM's msgspec layout (``array_like``, tagged by class name): fields in declaration order, the lora
    fields None (minipaged has no LoRA)."""
    if isinstance(event, BlockStored):
        return ["BlockStored", [external_hash(h) for h in event.block_hashes],
                None if event.parent_block_hash is None else external_hash(event.parent_block_hash),
                list(event.token_ids), event.block_size, None, MEDIUM, None]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", [external_hash(h) for h in event.block_hashes], MEDIUM]
    return ["AllBlocksCleared"]


def encode_batch(ts: float, events: list[KVCacheEvent], data_parallel_rank: int = 0) -> list[Any]:
    """vLLM's ``KVEventBatch``: [ts, events, data_parallel_rank] (msgpack it to send)."""
    return [ts, [encode_event(e) for e in events], data_parallel_rank]
