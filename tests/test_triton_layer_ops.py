"""The fused Triton layer ops (kernels/triton_layer_ops.py) against their specification (kernels/reference.py), in
Triton's CPU interpreter: small shapes, but each crossing the edges a kernel tiles at (several column blocks of
SiLU, several vocabulary tiles of argmax, a slot to skip, a padded head count). The engine on these kernels is
tests/test_triton_engine.py; the same kernels compile for a GPU under ``make gpu-check``.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"   # before any import of triton (as tests/test_triton_kernel.py)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from minipaged.kernels.reference import (add_rms_norm_reference, argmax_reference,  # noqa: E402
                                         rope_and_write_kv_reference, silu_and_mul_reference)
from minipaged.kernels.triton_layer_ops import ARGMAX_TILE, SILU_COLUMNS, TritonLayerOps, triton_argmax  # noqa: E402

OPS = TritonLayerOps()
# float32: the same operators in the same order, but the norm's sum is added up in another order. bfloat16: the
# interpreter rounds float32 to bfloat16 toward zero where a GPU rounds to nearest (a last bit in some elements).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_adds_in_place_then_normalises(dtype):
    gen = torch.Generator().manual_seed(0)
    residual, delta = torch.randn(3, 48, generator=gen).to(dtype), torch.randn(3, 48, generator=gen).to(dtype)
    weight = (torch.rand(48, generator=gen) + 0.5).to(dtype)
    want_residual, want = add_rms_norm_reference(residual, delta, weight, 1e-5)
    ours = residual.clone()
    got = OPS.add_rms_norm(ours, delta, weight, 1e-5)
    assert got.dtype == dtype
    exact = dict(atol=0, rtol=0) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(ours, want_residual, **exact)                 # the add, in place, as torch rounds
    torch.testing.assert_close(got, want, **TOL[dtype])
    untouched = residual.clone()
    torch.testing.assert_close(OPS.add_rms_norm(untouched, None, weight, 1e-5),
                               add_rms_norm_reference(residual, None, weight, 1e-5)[1], **TOL[dtype])
    assert torch.equal(untouched, residual)                                  # no delta: nothing added


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_write_kv_rotates_queries_and_keys_and_skips_cached_slots(dtype):
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, head_dim, tokens = 6, 2, 16, 3              # 6 query heads: padded to 8 inside the kernel
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 10
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)          # minipaged's signed table
    slots = torch.tensor([5, -1, 12])
    ours = [torch.zeros(4, 4, kv_heads, head_dim, dtype=dtype) for _ in range(2)]
    theirs = [torch.zeros(4, 4, kv_heads, head_dim, dtype=dtype) for _ in range(2)]
    q = OPS.rope_and_write_kv(qkv.clone(), cos, sin, *ours, slots, heads, kv_heads)
    q_ref = rope_and_write_kv_reference(qkv, cos, sin, *theirs, slots, heads, kv_heads)
    assert q.shape == (tokens, heads, head_dim)
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    torch.testing.assert_close(ours[0], theirs[0], **TOL[dtype])           # rotated keys, slot -1 left at zero
    assert torch.equal(ours[1], theirs[1])                                   # values: copied as they are
    assert ours[0].view(-1, kv_heads, head_dim).abs().sum((1, 2)).nonzero().flatten().tolist() == [5, 12]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_over_several_column_blocks(dtype):
    inter = SILU_COLUMNS + 37                                    # two column blocks, the second one ragged
    gate_up = (torch.randn(2, 2 * inter, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    torch.testing.assert_close(OPS.silu_and_mul(gate_up), silu_and_mul_reference(gate_up), **TOL[dtype])


def test_argmax_takes_the_first_index_across_tiles():
    vocab = 2 * ARGMAX_TILE + 300                                # three tiles, the last one ragged
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3))
    logits[0, [ARGMAX_TILE - 1, ARGMAX_TILE, vocab - 1]] = 50.0             # a tie across a tile edge
    logits[1, vocab - 1] = 60.0                                              # the maximum in the ragged tile
    logits[2, [7, 9]] = 70.0                                                 # a tie inside one tile
    logits[3] = float("-inf")                                                # a row that allows nothing: 0
    got = triton_argmax(logits)
    assert torch.equal(got, argmax_reference(logits))
    assert got.tolist()[:3] == [ARGMAX_TILE - 1, vocab - 1, 7] and got.dtype == torch.int64
    torch.testing.assert_close(triton_argmax(logits.bfloat16()), argmax_reference(logits.bfloat16()))


def test_bad_shapes_are_refused_with_what_is_expected():
    with pytest.raises(ValueError, match=r"rows, 2 \* inter"):
        OPS.silu_and_mul(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="residual"):
        OPS.add_rms_norm(torch.zeros(2, 8), None, torch.ones(7), 1e-5)
