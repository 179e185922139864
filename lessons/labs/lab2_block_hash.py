"""Lab 2: the prefix cache's block hash chain.

The student writes ``hash_block_tokens(parent_hash, token_ids, extra_keys)``, the engine's own being
``minipaged.block_pool.hash_block_tokens``; the checks call it alone, then plug it into a real
``KVCacheManager`` and look at which blocks are shared.
"""
from __future__ import annotations

from typing import Any

from minipaged.block_pool import ROOT_HASH, hash_block_tokens
from minipaged.kv_cache_manager import KVCacheManager
from minipaged.policies import LRUFreeBlockQueue
from minipaged.request import Request, SamplingParams

from .core import Lab, LabFailure, expect

STUB = '''"""Lab 2: the prefix cache's block hash chain. Fill in the TODO, then run `minipaged lab check 2`.

Every full KV block gets a hash; a new request whose first blocks' hashes are already in the cache reuses
those blocks instead of computing them. Two blocks may share a hash only when their keys and values are
equal, and a token's K and V depend on *every* token before it, not only on the tokens of its block.
extra_keys is anything else that changes a block's KV (a LoRA adapter, an image): () usually.
"""
import hashlib


def hash_block_tokens(parent_hash: bytes, token_ids: list, extra_keys: tuple = ()) -> bytes:
    """The hash of one full block; parent_hash is the hash of the block before it (b"" for the first)."""
    # TODO: return bytes that change whenever the parent, the tokens (and their order) or extra_keys change.
    # hashlib.sha256(some_bytes).digest() gives 32 bytes.
    raise NotImplementedError("hash_block_tokens")
'''


def returns_stable_bytes(fn: Any) -> None:
    """the hash is bytes, the same for the same block, and long enough not to collide"""
    first = fn(ROOT_HASH, [1, 2, 3, 4], ())
    expect(isinstance(first, bytes), f"the hash is a {type(first).__name__}; the engine chains bytes "
                                     f"(parent + block), so return bytes, e.g. hashlib.sha256(...).digest().")
    expect(fn(ROOT_HASH, [1, 2, 3, 4], ()) == first, "the same block hashed twice gave two hashes: a cache that "
                                                    "never finds its own blocks. Is there randomness in it?")
    expect(len(first) >= 16, f"your hash has {len(first) * 8} bits. A cache hit is trusted without comparing tokens, "
                             f"so a collision silently gives one prompt another's KV; 64-bit hashes (Python's hash()) "
                             f"can be made to collide on purpose (vLLM's CVE-2025-25183). Use SHA-256.")


def tokens_and_their_order_count(fn: Any) -> None:
    """different tokens, or the same tokens in another order, give another hash"""
    a = fn(ROOT_HASH, [1, 2, 3, 4], ())
    expect(fn(ROOT_HASH, [1, 2, 3, 5], ()) != a, "blocks [1, 2, 3, 4] and [1, 2, 3, 5] got the same hash.")
    expect(fn(ROOT_HASH, [4, 3, 2, 1], ()) != a, "[1, 2, 3, 4] and [4, 3, 2, 1] got the same hash: a sum, a set or a "
                                                 "sorted list loses the order, and attention does not.")
    expect(fn(ROOT_HASH, [12, 3], ()) != fn(ROOT_HASH, [1, 23], ()),
           "[12, 3] and [1, 23] got the same hash: gluing the ids' digits together ('123') is ambiguous. Hash "
           "something that keeps the ids apart, such as repr(list(token_ids)).")


def the_parent_is_part_of_the_hash(fn: Any) -> None:
    """the same tokens after a different prefix give another hash (the chain)"""
    after_a = fn(fn(ROOT_HASH, [1, 1, 1, 1], ()), [7, 7, 7, 7], ())
    after_b = fn(fn(ROOT_HASH, [2, 2, 2, 2], ()), [7, 7, 7, 7], ())
    expect(after_a != after_b, "block [7, 7, 7, 7] got the same hash after [1, 1, 1, 1] as after [2, 2, 2, 2]: your "
                               "hash leaves the parent out. A token's keys and values depend on every token before "
                               "it, so those two blocks hold different KV; sharing them would give the second prompt "
                               "the first one's attention. Hash the parent's hash together with the tokens.")


def extra_keys_count(fn: Any) -> None:
    """extra keys (a LoRA adapter, an image) change the hash"""
    expect(fn(ROOT_HASH, [1, 2], ("lora-a",)) != fn(ROOT_HASH, [1, 2], ()),
           "the same tokens under the adapter 'lora-a' got the hash they have without it: extra_keys change the "
           "KV, so they must change the hash.")


def shares_exactly_the_equal_prefixes(fn: Any) -> None:
    """inside the engine's KVCacheManager, only requests with an equal prefix share blocks"""
    kv = KVCacheManager(num_blocks=16, block_size=2, enable_caching=True, free_queue=LRUFreeBlockQueue,
                        hash_tokens=fn)
    params = SamplingParams(max_tokens=4)

    def admit(name: str, tokens: list[int]) -> int:
        req = Request(name, tokens, params, len(kv.req_blocks), 0.0)
        hits, cached = kv.find_cached_prefix(req)
        if not kv.allocate_slots(req, req.num_tokens - cached, cached, hits):
            raise LabFailure("the pool ran out of blocks in a small workload.")
        return cached

    admit("first", [1, 1, 7, 7, 5])
    expect(admit("same start", [1, 1, 7, 7, 9]) == 4, "a prompt starting with the same 4 tokens (2 full blocks) "
                                                      "found fewer than 4 of them in the cache.")
    got = admit("other start", [7, 7, 3, 3, 3])
    expect(got == 0, f"a prompt that starts [7, 7] found {got} tokens cached: its first block was matched to the "
                     f"second block of [1, 1, 7, 7, ...], whose keys and values were computed after [1, 1]. The "
                     f"position and the prefix are part of a block's identity: chain the parent's hash in.")
    kv.check_invariants()


def reference() -> Any:
    return hash_block_tokens


LAB = Lab(2, "lab2_block_hash", "The prefix cache's block hash chain", "hash_block_tokens", STUB, reference,
          (returns_stable_bytes, tokens_and_their_order_count, the_parent_is_part_of_the_hash, extra_keys_count,
           shares_exactly_the_equal_prefixes),
          install=lambda engine, fn: setattr(engine.kv, "hash_tokens", fn))
