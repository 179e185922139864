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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_ops_at_tinyllama_sizes(dtype):
    """The fused kernels compiled, at TinyLlama's sizes (hidden 2048, 32/4 heads of 128, MLP 5632, vocab 32000),
    against the specification; on a GPU bf16 rounds to nearest, as torch does, so bf16 is held close too."""
    from minipaged.kernels.reference import (add_rms_norm_reference, argmax_reference, rope_and_write_kv_reference,
                                             silu_and_mul_reference)
    from minipaged.kernels.triton_layer_ops import TritonLayerOps, triton_argmax
    ops, gen = TritonLayerOps(), torch.Generator(device="cuda").manual_seed(0)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)
    residual, delta, weight = randn(37, 2048), randn(37, 2048), randn(2048)
    want_residual, want = add_rms_norm_reference(residual, delta, weight, 1e-5)
    ours = residual.clone()
    torch.testing.assert_close(ops.add_rms_norm(ours, delta, weight, 1e-5), want, **tol)
    assert torch.equal(ours, want_residual)
    qkv = randn(37, (32 + 8) * 128)
    angles = torch.rand(37, 64, generator=gen, device="cuda") * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)
    slots = torch.randperm(64 * 16, generator=gen, device="cuda")[:37]
    slots[::5] = -1
    caches = [torch.zeros(64, 16, 4, 128, dtype=dtype, device="cuda") for _ in range(4)]
    q = ops.rope_and_write_kv(qkv.clone(), cos, sin, caches[0], caches[1], slots, 32, 4)
    q_ref = rope_and_write_kv_reference(qkv, cos, sin, caches[2], caches[3], slots, 32, 4)
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(caches[0], caches[2], **tol)
    assert torch.equal(caches[1], caches[3])
    gate_up = randn(37, 2 * 5632) * 4
    torch.testing.assert_close(ops.silu_and_mul(gate_up), silu_and_mul_reference(gate_up), **tol)
    logits = torch.randn(300, 32000, generator=gen, device="cuda")
    logits[3, [5, 31999]] = 99.0
    assert torch.equal(triton_argmax(logits), argmax_reference(logits))


def test_cuda_graphs_give_the_eager_engines_greedy_tokens(tiny_model):
    """The check that must pass before CUDA graphs may become the default: decode steps replayed from graphs
    (padded to the next captured size) give the tokens of the same engine run eagerly, under chunked prefill and
    prefix caching, with batches that grow and shrink."""
    from minipaged import Engine, SamplingParams
    prompts = [[(11 * i + j) % 250 for j in range(3 + 7 * i)] for i in range(11)]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 5 * (i % 4), ignore_eos=True) for i in range(11)]
    options = dict(device="cuda", dtype="float32", block_size=16, num_blocks=128, max_num_batched_tokens=48,
                   max_model_len=256)
    eager = Engine(tiny_model, **options).generate(prompts, params)
    engine = Engine(tiny_model, cuda_graphs=True, cudagraph_capture_sizes="1,2,4,8,12", **options)
    graphed = engine.generate(prompts, params)
    assert engine.runner.graphs.replays > 0 and engine.runner.graphs.eager_steps > 0
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
