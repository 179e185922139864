"""Every backend against the specification (kernels/reference.py, kernels/torch_ops.py): the shared checks a new
backend (one more file in kernels/backends/) must pass. Attention on a batch of decodes and prefill chunks
together, the K/V write, linear layers for a few rows and for many, the LM head, the layer ops and argmax.

The triton backend runs in Triton's CPU interpreter here (tiny shapes: the interpreter runs every program in
Python); tests/test_triton_gpu.py repeats the attention comparison at real sizes on a GPU.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"   # before any import of triton (as tests/test_triton_kernel.py)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from attention_batches import make_batch  # noqa: E402
from minipaged.kernels import (ALL_TORCH, CpuBackend, CpuChoice, TorchBackend, TritonBackend,  # noqa: E402
                               paged_attention_reference, triton_available, write_kv_cache)
from minipaged.kernels.backends.calibration import IN_OUT  # noqa: E402
from minipaged.kernels.torch_ops import TORCH_LAYER_OPS  # noqa: E402

HEAD_DIM = 16
TOL = dict(atol=1e-5, rtol=1e-5)


def backends():
    yield pytest.param(lambda: TorchBackend(), id="torch")
    yield pytest.param(lambda: CpuBackend(HEAD_DIM, CpuChoice()), id="cpu-compiled")
    yield pytest.param(lambda: CpuBackend(HEAD_DIM, ALL_TORCH), id="cpu-torch-ops")
    yield pytest.param(lambda: CpuBackend(HEAD_DIM, CpuChoice(few_row_linear=IN_OUT)), id="cpu-in-out")
    yield pytest.param(lambda: TritonBackend(), id="triton-interpreted",
                       marks=pytest.mark.skipif(not triton_available(), reason="Triton is not installed"))


@pytest.fixture(params=list(backends()))
def backend(request):
    return request.param()


def test_attention_on_decodes_and_prefill_chunks_together(backend):
    specs = [(37, 1), (20, 6), (9, 9), (50, 1), (3, 1)]       # (context, new tokens): decodes, a chunk, a prompt
    q, k_cache, v_cache, tables, seq_lens, starts = make_batch(specs, block_size=4, head_dim=HEAD_DIM, seed=3)
    tables = tables.clamp(min=0)                                 # the runner pads tables with a valid id
    want = paged_attention_reference(q, k_cache, v_cache, tables, seq_lens, starts, 0.25)
    plan = backend.plan(tables, 4, seq_lens.tolist(), starts.tolist())
    for _layer in range(2):                                      # one plan serves every layer of a step
        got = backend.attention(q, k_cache, v_cache, tables, seq_lens, starts, 0.25, plan)
        torch.testing.assert_close(got, want, **TOL)


def test_kv_write_skips_cached_slots(backend):
    gen = torch.Generator().manual_seed(1)
    key, value = torch.randn(5, 2, HEAD_DIM, generator=gen), torch.randn(5, 2, HEAD_DIM, generator=gen)
    slots = torch.tensor([3, 17, -1, 0, 30])
    caches = [torch.randn(8, 4, 2, HEAD_DIM, generator=gen) for _ in range(2)]
    ours, theirs = [c.clone() for c in caches], [c.clone() for c in caches]
    backend.write_kv(key, value, *ours, slots)
    write_kv_cache(key, value, *theirs, slots)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@pytest.mark.parametrize("rows", [1, 3, 7, 8, 40])
def test_linear_for_few_rows_and_many(backend, rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(72, 48, generator=gen)
    stored = backend.prepare_weight(weight)
    assert stored.shape == weight.shape and torch.equal(stored, weight)      # a layout, never other values
    x = torch.randn(rows, 48, generator=gen)
    torch.testing.assert_close(backend.linear(x, stored), F.linear(x, weight), rtol=1e-5, atol=1e-4)
    head = torch.randn(300, 48, generator=gen)
    torch.testing.assert_close(backend.lm_head(x, head), F.linear(x, head), rtol=1e-5, atol=1e-4)


def test_layer_ops(backend):
    gen = torch.Generator().manual_seed(2)
    ops, spec = backend.layer_ops, TORCH_LAYER_OPS
    residual, delta, weight = torch.randn(3, 48, generator=gen), torch.randn(3, 48, generator=gen), torch.rand(48) + .5
    ours, theirs = residual.clone(), residual.clone()
    torch.testing.assert_close(ops.add_rms_norm(ours, delta, weight, 1e-5), spec.add_rms_norm(theirs, delta, weight,
                                                                                                1e-5), **TOL)
    torch.testing.assert_close(ours, theirs, **TOL)
    heads, kv_heads, tokens = 4, 2, 3
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * HEAD_DIM, generator=gen)
    angles = torch.rand(tokens, HEAD_DIM // 2, generator=gen) * 10
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([-angles.sin(), angles.sin()], -1)
    slots = torch.tensor([5, -1, 12])
    our_caches = [torch.zeros(4, 4, kv_heads, HEAD_DIM) for _ in range(2)]
    their_caches = [torch.zeros(4, 4, kv_heads, HEAD_DIM) for _ in range(2)]
    q = ops.rope_and_write_kv(qkv.clone(), cos, sin, *our_caches, slots, heads, kv_heads)
    q_ref = spec.rope_and_write_kv(qkv.clone(), cos, sin, *their_caches, slots, heads, kv_heads)
    torch.testing.assert_close(q, q_ref, **TOL)
    torch.testing.assert_close(our_caches[0], their_caches[0], **TOL)
    assert torch.equal(our_caches[1], their_caches[1])
    gate_up = torch.randn(3, 64, generator=gen)
    torch.testing.assert_close(ops.silu_and_mul(gate_up.clone()), spec.silu_and_mul(gate_up.clone()), **TOL)


def test_argmax_first_index_on_ties(backend):
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(4))
    logits[2, [7, 90]] = 50.0
    assert torch.equal(backend.argmax(logits), logits.argmax(dim=-1)) and backend.argmax(logits)[2] == 7


def test_kv_pool_is_zeroed_and_has_the_asked_shape(backend):
    pool = backend.allocate_kv_pool((2, 2, 3, 4, 2, HEAD_DIM), torch.float32, torch.device("cpu"))
    assert pool.shape == (2, 2, 3, 4, 2, HEAD_DIM) and not pool.any()
    assert backend.describe().startswith(backend.name)
