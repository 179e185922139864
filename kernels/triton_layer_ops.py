"""A layer's small operations as fused Triton kernels: fewer launches per decode step on a GPU.

Why: on a GPU a decode step of a 1B model is short (the weights stream through in well under a millisecond), and
torch runs each small operation as its own kernel launch. The specification (kernels/torch_ops.py,
``TorchLayerOps``) spends about a dozen launches a layer on the norms, RoPE, the K/V write and SiLU:
``residual += delta`` then RMSNorm is eight (add, cast, pow, mean, add, rsqrt, mul, cast, mul), RoPE is five
(roll, two muls, an add, the split) plus the K/V write, SiLU-and-mul two. Here each is one kernel:

    add_rms_norm        one program per row: add the sublayer's output into the residual (in place), normalise
    rope_and_write_kv   one program per token: rotate its queries (in place in ``qkv``) and its keys, write the
                        rotated keys and the values straight into their cache slot (-1: skip)
    silu_and_mul        one program per row and slice of columns: silu(gate) * up
    argmax              one program per row: the first index of the row's maximum (greedy sampling's tail)

Each rounds where the specification rounds (to the tensor's dtype after each operator torch would run on its
own), so in float32 they compute what ``TorchLayerOps`` computes, up to the order of the norm's sum; fp
contraction (a*b+c as one FMA) is turned off on the GPU for the same reason. tests/test_triton_layer_ops.py
checks each against the specification in Triton's interpreter, and tests/test_triton_engine.py the engine.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_paged_attention import _check_device, _kernel, _next_pow2

__all__ = ["TritonLayerOps", "triton_argmax"]

SILU_COLUMNS = 1024       # columns of silu_and_mul per program
ARGMAX_TILE = 1024        # vocabulary entries per loop iteration of argmax


def _add_rms_norm_kernel(residual_ptr, delta_ptr, weight_ptr, out_ptr, hidden, eps,
                         stride_r, stride_d, stride_o,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = residual_ptr.dtype.element_ty
    r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_d + cols, mask=mask, other=0.0)
        r = (r.to(tl.float32) + d.to(tl.float32)).to(dtype)       # rounded as torch's ``residual += delta``
        tl.store(residual_ptr + row * stride_r + cols, r, mask=mask)
    x = r.to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, 0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed.to(dtype).to(tl.float32)).to(dtype), mask=mask)


def _rope_and_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
                              stride_t, stride_cos, stride_sin,
                              stride_kcb, stride_kco, stride_kch, stride_kcd,
                              stride_vcb, stride_vco, stride_vch, stride_vcd,
                              NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                              KV_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    dtype = qkv_ptr.dtype.element_ty
    dims = tl.arange(0, HEAD_DIM)
    rolled = (dims + HEAD_DIM // 2) % HEAD_DIM            # torch.roll by half a head: the other half's element
    cos = tl.load(cos_ptr + t * stride_cos + dims).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + t * stride_sin + dims).to(tl.float32)[None, :]
    row = qkv_ptr + t * stride_t
    # Queries: rotated in place (the attention reads them from qkv).
    heads = tl.arange(0, HEADS_PAD)
    q_mask = (heads < NUM_HEADS)[:, None]
    q_at = row + heads[:, None] * HEAD_DIM
    # apply_rope's x * cos + roll(x, half) * signed_sin, rounded after each operator as torch rounds. (Written
    # out twice, here and for the keys: a helper would have to be a @triton.jit function, which this file's
    # kernels, built both compiled and interpreted, cannot call.)
    q_cos = (tl.load(q_at + dims[None, :], mask=q_mask, other=0.0).to(tl.float32) * cos).to(dtype)
    q_sin = (tl.load(q_at + rolled[None, :], mask=q_mask, other=0.0).to(tl.float32) * sin).to(dtype)
    q = (q_cos.to(tl.float32) + q_sin.to(tl.float32)).to(dtype)
    tl.store(q_at + dims[None, :], q, mask=q_mask)
    # Keys (rotated) and values: straight to the token's cache slot, unless it is -1 (already cached).
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        kv_heads = tl.arange(0, KV_PAD)
        kv_mask = (kv_heads < NUM_KV_HEADS)[:, None]
        k_at = row + (NUM_HEADS + kv_heads[:, None]) * HEAD_DIM
        k_cos = (tl.load(k_at + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32) * cos).to(dtype)
        k_sin = (tl.load(k_at + rolled[None, :], mask=kv_mask, other=0.0).to(tl.float32) * sin).to(dtype)
        k = (k_cos.to(tl.float32) + k_sin.to(tl.float32)).to(dtype)
        v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS + kv_heads[:, None]) * HEAD_DIM + dims[None, :], mask=kv_mask)
        tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kco + kv_heads[:, None] * stride_kch
                 + dims[None, :] * stride_kcd, k, mask=kv_mask)
        tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vco + kv_heads[:, None] * stride_vch
                 + dims[None, :] * stride_vcd, v, mask=kv_mask)


def _silu_and_mul_kernel(gate_up_ptr, out_ptr, inter, stride_in, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = gate_up_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)        # F.silu, rounded, then times up
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(dtype), mask=mask)


def _argmax_kernel(logits_ptr, out_ptr, vocab, stride_row, TILE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    best = tl.full([], float("-inf"), tl.float32)
    best_index = tl.full([], 0, tl.int32)
    for start in range(0, vocab, TILE):
        cols = start + tl.arange(0, TILE)
        x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        tile_best = tl.max(x, 0)
        tile_index = tl.argmax(x, 0, tie_break_left=True) + start       # the first index within the tile
        better = tile_best > best                                        # strictly: an earlier tile wins ties
        best_index = tl.where(better, tile_index, best_index)
        best = tl.where(better, tile_best, best)
    tl.store(out_ptr + row, best_index.to(tl.int64))


def _launch_options(interpreted: bool) -> dict:
    """No fp contraction on the GPU (an FMA rounds once where the specification rounds twice)."""
    return {} if interpreted else {"enable_fp_fusion": False}


class TritonLayerOps:
    """``TorchLayerOps``' three methods (kernels/torch_ops.py, the specification) as one Triton kernel each, for
    CUDA tensors, or CPU tensors in Triton's interpreter."""

    def add_rms_norm(self, residual: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """``residual += delta`` (in place; skipped when ``delta`` is None), then RMSNorm of ``residual``."""
        if residual.dim() != 2 or residual.stride(1) != 1 or weight.shape != (residual.shape[1],) \
                or (delta is not None and (delta.shape != residual.shape or delta.stride(1) != 1)):
            raise ValueError("add_rms_norm takes residual [rows, hidden] with contiguous rows, delta the same "
                             "shape or None, weight [hidden]")
        interpreted = _check_device(residual, weight, *(() if delta is None else (delta,)))
        out = torch.empty_like(residual)
        if residual.shape[0]:
            _kernel(_add_rms_norm_kernel, interpreted)[(residual.shape[0],)](
                residual, residual if delta is None else delta, weight.contiguous(), out, residual.shape[1],
                float(eps), residual.stride(0), 0 if delta is None else delta.stride(0), out.stride(0),
                HAS_DELTA=delta is not None, BLOCK=_next_pow2(residual.shape[1]), **_launch_options(interpreted))
        return out

    def rope_and_write_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                          **_hints: object) -> torch.Tensor:
        """Rotate the queries (in place in ``qkv``) and keys, write keys and values to each token's slot (-1:
        skip); return the queries ``[tokens, num_heads, head_dim]``, a view of ``qkv``."""
        tokens, head_dim = qkv.shape[0], k_cache.shape[-1]
        if not (qkv.dim() == 2 and qkv.stride(1) == 1 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
                and cos.shape == sin.shape == (tokens, head_dim) and cos.stride(1) == sin.stride(1) == 1
                and k_cache.dim() == 4 and k_cache.shape[2] == num_kv_heads and v_cache.shape == k_cache.shape
                and slot_mapping.shape == (tokens,) and head_dim & (head_dim - 1) == 0):
            raise ValueError("rope_and_write_kv takes qkv [tokens, (heads + 2 * kv_heads) * head_dim], cos and sin "
                             "[tokens, head_dim], caches [blocks, block_size, kv_heads, head_dim] (head_dim a power "
                             "of two), slots [tokens]")
        interpreted = _check_device(qkv, cos, sin, k_cache, v_cache, slot_mapping)
        if tokens:
            _kernel(_rope_and_write_kv_kernel, interpreted)[(tokens,)](
                qkv, cos, sin, slot_mapping, k_cache, v_cache, qkv.stride(0), cos.stride(0), sin.stride(0),
                *k_cache.stride(), *v_cache.stride(),
                NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEADS_PAD=_next_pow2(num_heads),
                KV_PAD=_next_pow2(num_kv_heads), HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
                **_launch_options(interpreted))
        return qkv[:, :num_heads * head_dim].view(tokens, num_heads, head_dim)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for the fused ``[rows, 2 * inter]`` gate|up output."""
        if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
            raise ValueError("silu_and_mul takes gate|up [rows, 2 * inter] with contiguous rows")
        interpreted = _check_device(gate_up)
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
        if rows:
            block = min(SILU_COLUMNS, _next_pow2(inter))
            _kernel(_silu_and_mul_kernel, interpreted)[(rows, triton.cdiv(inter, block))](
                gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block, **_launch_options(interpreted))
        return out


def triton_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy sampling's argmax (``torch_argmax``: the first index of each row's maximum) as one kernel launch.
    (A NaN row is not defined here: torch would pick the NaN; the engine's logits never hold one.)"""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"argmax takes logits [rows, vocab]; got shape {tuple(logits.shape)}")
    interpreted = _check_device(logits)
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if logits.shape[0]:
        _kernel(_argmax_kernel, interpreted)[(logits.shape[0],)](
            logits, out, logits.shape[1], logits.stride(0), TILE=min(ARGMAX_TILE, _next_pow2(logits.shape[1])))
    return out
