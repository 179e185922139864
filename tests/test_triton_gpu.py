"""The compiled Triton kernels on a real GPU, at model sizes: head_dim 128, GQA 8 (32 query / 4 KV heads),
bf16, contexts up to 8k. Skipped without CUDA. (CUDA tensors always take the compiled kernel, even if the
interpreter tests set TRITON_INTERPRET=1 earlier in the same process.)
"""
import random

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4),
       torch.float16: dict(atol=5e-3, rtol=5e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def make_batch(specs, *, block_size=16, num_kv_heads=4, num_heads=32, head_dim=128, dtype=torch.bfloat16,
               seed=0):
    """(seq_len, q_len) pairs -> tensors on CUDA, blocks shuffled over a pool with spare blocks, -1 padding."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    needed = [-(-s // block_size) for s, _ in specs]
    num_blocks = sum(needed) + 64
    perm = torch.randperm(num_blocks, generator=gen, device="cuda").int()
    tables = torch.full((len(specs), max(needed) + 4), -1, dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(needed):
        tables[i, :n] = perm[used:used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    v_cache = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    starts = [0]
    for _, q_len in specs:
        starts.append(starts[-1] + q_len)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=gen, device="cuda").to(dtype)
    seq_lens = torch.tensor([s for s, _ in specs], dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, tables, seq_lens, torch.tensor(starts, dtype=torch.int32, device="cuda")


def check(batch, dtype, **kw):
    from minipaged.kernels import paged_attention_reference
    from minipaged.kernels.triton_paged_attention import paged_attention_triton
    q, k_cache, v_cache, tables, seq_lens, starts = batch
    scale = q.shape[-1] ** -0.5
    out = paged_attention_triton(q, k_cache, v_cache, tables, seq_lens, starts, scale, **kw)
    ref = paged_attention_reference(q, k_cache, v_cache, tables, seq_lens, starts, scale)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_decode_batch_long_contexts(block_size, num_splits):
    rng = random.Random(block_size)
    specs = [(rng.randint(1, 8192), 1) for _ in range(12)] + [(8192, 1), (1, 1), (4097, 1)]
    check(make_batch(specs, block_size=block_size), torch.bfloat16, num_splits=num_splits)


@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch(block_size):
    specs = [(4096 + 512, 512),      # a prefill chunk on top of 4k cached tokens
             (1000, 1000),           # a whole prompt
             (8000, 1), (37, 1), (2049, 1),
             (300, 3), (64, 0)]      # a short chunk, an idle request
    check(make_batch(specs, block_size=block_size, seed=block_size), torch.bfloat16)
    check(make_batch(specs, block_size=block_size, seed=block_size), torch.bfloat16, num_splits=3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 32, 64), (24, 8, 128), (32, 8, 64)])
def test_other_dtypes_and_groups(dtype, num_heads, num_kv_heads, head_dim):
    specs = [(2048, 1), (777, 1), (1500, 200), (129, 129)]
    check(make_batch(specs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype),
          dtype)


def test_write_kv_cache_matches_reference():
    from minipaged.kernels import write_kv_cache
    from minipaged.kernels.triton_paged_attention import write_kv_cache_triton
    k_cache = torch.randn(512, 16, 4, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    key, value = (torch.randn(300, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    slots = torch.randperm(512 * 16, device="cuda")[:300]
    slots[::7] = -1
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv_cache(key, value, want_k, want_v, slots)
    write_kv_cache_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_dispatcher_picks_triton_on_cuda(monkeypatch):
    import kernel_dispatch as kernels
    from minipaged.kernels import paged_attention_reference
    from minipaged.kernels import triton_paged_attention as tpa
    called = []
    real = tpa.paged_attention_triton
    monkeypatch.setattr(tpa, "paged_attention_triton", lambda *a, **k: called.append(k) or real(*a, **k))
    batch = make_batch([(100, 1), (50, 10)])
    out = kernels.paged_attention(*batch, 0.1, host_seq_lens=[100, 50], host_query_start_loc=[0, 1, 11])
    assert called == [{"max_seq_len": 100, "max_query_len": 10}]
    torch.testing.assert_close(out.float(), paged_attention_reference(*batch, 0.1).float(),
                               **TOL[torch.bfloat16])
