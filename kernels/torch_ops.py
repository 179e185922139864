"""The model's small operations as plain torch operators: the specification every backend's faster version is
checked against (transformers' own math), and what the torch and triton backends run.

They live here, beside the kernels, rather than in the model, because they are the part a backend may
replace: the cpu backend runs ``TorchLayerOps``' three methods as compiled C (cpu_layer_ops.c), a GPU backend
writes K/V with its own kernel. minipaged/model/llama.py re-exports them for readers of the model.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .reference import write_kv_cache

# Vocabulary rows per slice when a CPU computes the LM head (see vocab_sliced_linear).
LM_HEAD_SLICE_ROWS = 1024


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm exactly as transformers' LlamaRMSNorm computes it (in fp32, then back). (torch's own
    ``F.rms_norm`` gives the same bits in fp32, but on a CPU it is these same operators and more, not one
    fused kernel: measured no faster.)"""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def vocab_sliced_linear(x: torch.Tensor, weight: torch.Tensor, rows_per_slice: Optional[int] = None) -> torch.Tensor:
    """``F.linear(x, weight)`` for the LM head, computed ``rows_per_slice`` vocabulary rows at a time on a CPU.

    Why: the LM head is the largest matrix of a small model (SmolLM2: 49,152 x 576, 113 MB, a fifth of its
    weights), and torch's CPU matmul runs it as one product whose [rows, vocab] output overflows the caches.
    In slices of 1024 vocabulary rows each product's output stays in cache, and every logit is still one dot
    product over the hidden size (SmolLM2's logits came out bit-identical on the CI machine; a slice that
    leaves a ragged remainder can round its last digit differently, as any change of matmul tiling can).
    Measured there, one thread, interleaved runs: 64 rows 64 -> 47 ms, 16 rows 30 -> 24 ms, 2 rows 23 -> 16 ms
    (up to 7 rows the cpu backend's compiled loop may take those rows, where it measured faster);
    one row gains nothing from slicing (the compiled loop does: 9.8 -> 4.3 ms), nor do the layers' smaller
    matrices. A GPU's matmul has no such problem: there this is plain ``F.linear``.
    """
    rows_per_slice = rows_per_slice or LM_HEAD_SLICE_ROWS
    if x.device.type != "cpu" or x.shape[0] < 2 or weight.shape[0] <= rows_per_slice:
        return F.linear(x, weight)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    for start in range(0, weight.shape[0], rows_per_slice):
        stop = start + rows_per_slice
        torch.matmul(x, weight[start:stop].t(), out=out[:, start:stop])
    return out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in Llama's rotate-half form: x * cos + rotate_half(x) * sin, where rotate_half(x)
    is [-x2, x1] for the two halves x1, x2. The same thing, bit for bit, in fewer operators:
    rotate_half(x) * sin = roll(x, half) * signed_sin, with the minus sign kept in the table
    (signed_sin = [-sin1, sin2]); negating is exact, so nothing rounds differently."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


WriteKv = Callable[..., None]


class TorchLayerOps:
    """A layer's small operations as torch operators: the specification (transformers' own math). The cpu
    backend runs the same three in compiled C (``CpuLayerOps``, kernels/cpu_layer_ops.c), one call each instead
    of a dozen operators; the layer loop does not know which. ``write_kv``: how new keys and values reach the
    cache (torch's indexing, or a backend's kernel; called with ``all_slots_new``, see ``write_kv_cache``)."""

    def __init__(self, write_kv: WriteKv = write_kv_cache) -> None:
        self.write_kv = write_kv

    def add_rms_norm(self, residual: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """Add ``delta`` (the last sublayer's output) to the residual stream in place, then normalise it."""
        if delta is not None:
            residual += delta
        return rms_norm(residual, weight, eps)

    def rope_and_write_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                          *, all_slots_new: bool = False) -> torch.Tensor:
        """Rotate queries and keys, write the new tokens' keys and values to the cache; return the queries."""
        num_tokens, head_dim = qkv.shape[0], k_cache.shape[-1]
        q_and_k = (num_heads + num_kv_heads) * head_dim
        # Queries and keys get the same rotation, so rotate them together: [T, heads + kv_heads, dim].
        qk = qkv[:, :q_and_k].view(num_tokens, num_heads + num_kv_heads, head_dim)
        q, k = apply_rope(qk, cos.unsqueeze(1), sin.unsqueeze(1)).split([num_heads, num_kv_heads], dim=1)
        v = qkv[:, q_and_k:].view(num_tokens, num_kv_heads, head_dim)
        self.write_kv(k, v, k_cache, v_cache, slot_mapping, all_slots_new=all_slots_new)
        return q

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's middle: silu(gate) * up, from the fused gate|up output."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)                         # in place: one tensor fewer


TORCH_LAYER_OPS = TorchLayerOps()
