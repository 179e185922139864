"""The Triton PagedAttention kernels against the torch reference, in Triton's CPU interpreter.

The interpreter runs every program of the grid in Python/numpy, so shapes here are tiny (head_dim 16/32,
contexts under ~100 tokens) and cases few; the same comparison at real sizes lives in test_triton_gpu.py.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"   # before any import of triton

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from minipaged.kernels import paged_attention_reference, write_kv_cache  # noqa: E402
from minipaged.kernels.triton_paged_attention import (  # noqa: E402
    choose_num_splits, paged_attention_triton, write_kv_cache_triton)

from attention_batches import make_batch, random_specs  # noqa: E402
from kernel_dispatch import choose_backend, paged_attention, plan_attention, write_kv  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5),
       torch.float16: dict(atol=3e-3, rtol=3e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def check(batch, dtype, **kw):
    q, k_cache, v_cache, tables, seq_lens, starts = batch
    scale = q.shape[-1] ** -0.5
    out = paged_attention_triton(q, k_cache, v_cache, tables, seq_lens, starts, scale, **kw)
    ref = paged_attention_reference(q, k_cache, v_cache, tables, seq_lens, starts, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype,group,block_size,head_dim,seed", [
    (torch.float32, 1, 16, 16, 0),
    (torch.float16, 3, 32, 32, 1),
    (torch.bfloat16, 4, 16, 16, 2),
    (torch.float32, 8, 32, 16, 3),
    (torch.float16, 4, 32, 16, 4),
])
def test_mixed_batch_matches_reference(dtype, group, block_size, head_dim, seed):
    specs = random_specs(random.Random(seed), 5) + [(7, 1), (33, 0)]   # always a decode and an idle request
    random.Random(seed).shuffle(specs)
    batch = make_batch(specs, block_size=block_size, group=group, head_dim=head_dim, dtype=dtype, seed=seed)
    check(batch, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_batch_gqa8(dtype):
    specs = [(1, 1), (15, 1), (16, 1), (17, 1), (50, 1)]           # around block boundaries
    check(make_batch(specs, group=8, num_kv_heads=1, dtype=dtype), dtype)


@pytest.mark.parametrize("num_splits", [2, 3, 5])
def test_split_k_decode(num_splits):
    specs = [(3, 1), (70, 1), (129, 1)]      # 3 tokens cannot fill 5 splits: empty splits must weigh 0
    check(make_batch(specs, group=4, block_size=16, seed=num_splits), torch.float32,
          num_splits=num_splits, tile_n=16)


def test_split_k_mixed_batch():
    specs = [(40, 1), (60, 13), (20, 20), (90, 1)]
    check(make_batch(specs, group=3, block_size=32, dtype=torch.float16), torch.float16, num_splits=3, tile_n=16)


def test_default_split_heuristic_on_long_decode():
    # choose_num_splits in the interpreter assumes 4 "SMs": one request x 1 KV head -> split by length.
    assert choose_num_splits(1, 1, 600, 1, num_sms=4) == 2
    check(make_batch([(600, 1)], group=4, num_kv_heads=1, block_size=32), torch.float32)


@pytest.mark.parametrize("block_size,tile_n", [(32, 16), (16, 64)])
def test_key_tiles_smaller_or_larger_than_blocks(block_size, tile_n):
    specs = [(45, 1), (70, 9), (5, 5)]
    check(make_batch(specs, block_size=block_size, group=2, table_stride=2), torch.float32, tile_n=tile_n)


def test_non_contiguous_inputs():
    q, k_cache, v_cache, tables, seq_lens, starts = make_batch([(30, 1), (50, 6)], group=2, head_dim=16,
                                                                 table_stride=3)
    # q as a slice of a fused qkv projection, caches as views with a padded head dimension.
    fused = torch.randn(q.shape[0], q.shape[1] * 3, 16)
    fused[:, :q.shape[1]] = q
    q = fused[:, :q.shape[1]]
    big_k = torch.randn(*k_cache.shape[:3], 32)
    big_v = torch.randn(*v_cache.shape[:3], 32)
    big_k[..., :16], big_v[..., :16] = k_cache, v_cache
    k_view, v_view = big_k[..., :16], big_v[..., :16]
    assert not (q.is_contiguous() or k_view.is_contiguous() or tables.is_contiguous())
    check((q, k_view, v_view, tables, seq_lens.long(), starts.long()), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache(dtype):
    num_blocks, block_size, kv_heads, head_dim = 6, 16, 3, 16
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(5, kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(5, kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.tensor([3 * block_size + 5, -1, 0, num_blocks * block_size - 1, -1])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv_cache(key, value, want_k, want_v, slots)
    write_kv_cache_triton(key, value, k_cache, v_cache, slots.int())
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_errors_name_what_is_supported(monkeypatch):
    q, k_cache, v_cache, tables, seq_lens, starts = make_batch([(10, 1)], group=2)
    args = (tables, seq_lens, starts, 0.25)
    with pytest.raises(ValueError, match=r"head_dim 24 is not supported.*\(16, 32, 64, 128\)"):
        paged_attention_triton(torch.randn(1, 4, 24), torch.randn(2, 16, 2, 24), torch.randn(2, 16, 2, 24), *args)
    with pytest.raises(ValueError, match="must be a multiple of num_kv_heads"):
        paged_attention_triton(torch.randn(1, 5, 16), k_cache, v_cache, *args)
    with pytest.raises(ValueError, match="dtype mismatch"):
        paged_attention_triton(q.half(), k_cache, v_cache, *args)
    with pytest.raises(ValueError, match="supported: float16, bfloat16, float32"):
        paged_attention_triton(q.double(), k_cache.double(), v_cache.double(), *args)
    with pytest.raises(ValueError, match="int32 or int64"):
        paged_attention_triton(q, k_cache, v_cache, tables.float(), seq_lens, starts, 0.25)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention_triton(q, k_cache, v_cache, tables, seq_lens, starts[:1], 0.25)
    with pytest.raises(ValueError, match="tile_n"):
        paged_attention_triton(q, k_cache, v_cache, *args, tile_n=24)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache_triton(q[:, :2], q[:, :2], k_cache, v_cache, torch.zeros(3, dtype=torch.int64))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="need CUDA tensors.*TRITON_INTERPRET=1"):
        paged_attention_triton(q, k_cache, v_cache, *args)


def test_dispatcher(monkeypatch):
    batch = make_batch([(20, 1), (40, 8)], group=2)
    q, k_cache, v_cache, tables, seq_lens, starts = batch
    ref = paged_attention_reference(*batch, 0.25)
    # CPU tensors default to the torch path, which takes (and the Triton path translates) host-side hints.
    hints = dict(host_seq_lens=seq_lens.tolist(), host_query_start_loc=starts.tolist())
    torch.testing.assert_close(paged_attention(*batch, 0.25, **hints), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(paged_attention(*batch, 0.25, backend="triton", **hints), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(paged_attention(*batch, 0.25, backend="torch", num_splits=2), ref,
                               atol=1e-5, rtol=1e-5)
    assert choose_backend(q) == "torch" and choose_backend(q, "triton") == "triton"
    with pytest.raises(ValueError, match="unknown attention backend"):
        paged_attention(*batch, 0.25, backend="cuda")
    with pytest.raises(TypeError, match="unexpected keyword"):
        paged_attention(*batch, 0.25, max_len=3)
    key, value = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    slots = torch.tensor([1, 17])
    for backend in ("torch", "triton"):
        kc, vc = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
        write_kv(key, value, kc, vc, slots, backend=backend)
        assert torch.equal(kc[0, 1], key[0]) and torch.equal(vc[1, 1], value[1])


def test_choose_num_splits():
    assert choose_num_splits(1, 4, 32768, 1, num_sms=132) == 64      # small batch, long context: many
    assert choose_num_splits(256, 4, 32768, 1, num_sms=132) == 1     # the batch already fills the card
    assert choose_num_splits(1, 4, 300, 1, num_sms=132) == 1         # too short to be worth splitting
    assert choose_num_splits(1, 4, 32768, 16, num_sms=132) == 1      # prefill chunks bring their own tiles


@pytest.mark.parametrize("seed", range(24))
def test_random_configurations(seed):
    """Seeded sweep over everything at once: dtype, GQA ratio, block size, head_dim, splits, key-tile width."""
    rng = random.Random(1000 + seed)
    dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
    group = rng.choice([1, 3, 4, 8])
    num_kv_heads = rng.choice([1, 2]) if group < 8 else 1
    block_size = rng.choice([16, 32])
    head_dim = rng.choice([16, 32, 64])
    decode_only = rng.random() < 0.4
    specs = [(rng.randint(1, 100), 1) for _ in range(rng.randint(1, 4))] if decode_only \
        else random_specs(rng, rng.randint(1, 5), max_ctx=100)
    kw = {}
    if rng.random() < 0.5:
        kw["num_splits"] = rng.randint(2, 4)
    if rng.random() < 0.5:
        kw["tile_n"] = rng.choice([16, 32, 64])
    batch = make_batch(specs, block_size=block_size, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                       dtype=dtype, seed=seed, table_stride=rng.choice([1, 2]))
    if rng.random() < 0.5:   # the hints the engine passes to skip device->host syncs
        q_lens = [q for _, q in specs]
        kw.update(max_query_len=max(q_lens), max_seq_len=max(s for s, _ in specs))
    check(batch, dtype, **kw)


@pytest.mark.parametrize("seed", range(12))
def test_torch_path_matches_reference(seed):
    """The CPU path (decodes batched, chunks one by one, a per-step plan shared by every layer) against the
    one-request-at-a-time reference: mixed batches, padded (-1) block tables, idle requests, GQA or not."""
    rng = random.Random(2000 + seed)
    group, block_size = rng.choice([1, 3]), rng.choice([4, 16])
    decode_only = rng.random() < 0.4
    specs = [(rng.randint(1, 90), 1) for _ in range(rng.randint(1, 5))] if decode_only \
        else random_specs(rng, rng.randint(1, 6), max_ctx=90) + [(rng.randint(1, 40), 0)]
    rng.shuffle(specs)
    batch = make_batch(specs, block_size=block_size, group=group, seed=seed, table_stride=rng.choice([1, 2]))
    q, k_cache, v_cache, tables, seq_lens, starts = batch
    ref = paged_attention_reference(*batch, 0.3)
    hints = plan_attention(tables, block_size, seq_lens.tolist(), starts.tolist(), backend="torch")
    for kw in ({}, hints):                     # planned inside the call, or once for every layer
        torch.testing.assert_close(paged_attention(*batch, 0.3, backend="torch", **kw), ref, atol=1e-5, rtol=1e-5)


def test_benchmark_script_is_wired():
    """bench/paged_attention.py: its CPU smoke mode runs end to end; without CUDA the real run exits 2."""
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parent.parent / "bench" / "paged_attention.py"
    if not script.exists():
        pytest.skip("bench/paged_attention.py is not in this checkout")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)   # the script must set it itself in smoke mode
    smoke = subprocess.run([sys.executable, str(script), "--interpret-smoke"], capture_output=True, text=True,
                           env=env, timeout=120)
    assert smoke.returncode == 0, smoke.stderr
    assert "decode b=3 ctx=600" in smoke.stdout
    if not torch.cuda.is_available():
        real = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)
        assert real.returncode == 2 and "needs a CUDA GPU" in real.stderr
