"""Batches of paged attention inputs for the kernel tests: requests in shuffled blocks of one pool."""
from __future__ import annotations

import random

import torch


def make_batch(specs, *, block_size=16, num_kv_heads=2, group=2, head_dim=16, dtype=torch.float32, seed=0,
               table_stride=1):
    """A batch of requests given as (seq_len, q_len) pairs, stored in shuffled blocks of one pool.

    Block tables are padded with -1 (the kernel must never read past a request's last block) and, with
    ``table_stride`` > 1, are a strided view (non-contiguous columns).
    """
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s, _ in specs]
    num_blocks = sum(needed) + 3                     # a few blocks nobody owns
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(needed) + 2
    wide = torch.full((len(specs), width * table_stride), -1, dtype=torch.int32)
    tables = wide[:, ::table_stride]
    used = 0
    for i, n in enumerate(needed):
        tables[i, :n] = perm[used:used + n]
        used += n
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    q_lens = [q for _, q in specs]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], num_kv_heads * group, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor([s for s, _ in specs], dtype=torch.int32)
    return q, k_cache, v_cache, tables, seq_lens, torch.tensor(starts, dtype=torch.int32)


def random_specs(rng: random.Random, n: int, max_ctx: int = 80):
    """A mix of decodes, prefill chunks on top of cached context, and whole prompts."""
    specs = []
    for _ in range(n):
        kind = rng.choice(["decode", "decode", "chunk", "prompt"])
        if kind == "decode":
            specs.append((rng.randint(1, max_ctx), 1))
        elif kind == "chunk":
            q_len = rng.randint(2, 20)
            specs.append((rng.randint(0, max_ctx - 20) + q_len, q_len))
        else:
            q_len = rng.randint(2, 24)
            specs.append((q_len, q_len))
    return specs
