"""A layer's small operations (norm with the residual add, RoPE with the K/V write, SiLU times up) through the
compiled library (cpu_layer_ops.c): one call each instead of a handful of torch operators.

``CpuLayerOps`` has the interface of ``TorchLayerOps`` in minipaged/model/llama.py, which is the readable
specification (transformers' own math); the layer loop calls whichever its backend picks. Results agree with
it to float rounding (the C sums run in another order).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .build import load_kernel, profiler_name

PROFILER_NAMES = {name: f"minipaged::{name}" for name in ("add_rms_norm", "rope_and_write_kv", "silu_and_mul")}


def bad_slots_error(bad: int, num_slots: int, slot_mapping: torch.Tensor) -> ValueError:
    """What a compiled K/V write says when ``bad`` of its slots lay outside the cache (it wrote none of those)."""
    return ValueError(f"{bad} cache slots outside 0..{num_slots - 1} (or -1 to skip): {slot_mapping.tolist()}")


def _readable(t: torch.Tensor) -> bool:
    """C reads the memory as it lies: float32, on the CPU, contiguous. (Checked on every call, so that a
    wrong tensor raises instead of being read out of bounds; a few hundred nanoseconds each.)"""
    return t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()


class CpuLayerOps:
    """The compiled versions of ``TorchLayerOps``' three methods, for contiguous float32 CPU tensors."""

    def __init__(self, head_dim: int) -> None:
        self.library = load_kernel(head_dim)

    def add_rms_norm(self, residual: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """``residual += delta`` (in place; skipped when ``delta`` is None), then RMSNorm of ``residual``."""
        if not (_readable(residual) and _readable(weight) and residual.dim() == 2
                and residual.shape[1] == weight.shape[0]
                and (delta is None or (_readable(delta) and delta.shape == residual.shape))):
            raise ValueError("add_rms_norm takes contiguous float32 CPU tensors: residual [rows, hidden], delta "
                             "the same shape or None, weight [hidden]")
        out = torch.empty_like(residual)
        with profiler_name(PROFILER_NAMES["add_rms_norm"]):
            self.library.add_rms_norm(residual.data_ptr(), None if delta is None else delta.data_ptr(),
                                      weight.data_ptr(), out.data_ptr(), residual.shape[0], residual.shape[1],
                                      eps, torch.get_num_threads())
        return out

    def rope_and_write_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                          **_hints) -> torch.Tensor:
        """Rotate the queries and keys of ``qkv`` in place, write each token's K and V to its slot (-1: skip),
        return the queries ``[tokens, num_heads, head_dim]`` (a view of ``qkv``)."""
        tokens, head_dim = qkv.shape[0], k_cache.shape[-1]
        if not (_readable(qkv) and _readable(cos) and _readable(sin) and _readable(k_cache) and _readable(v_cache)
                and slot_mapping.dtype == torch.int64 and slot_mapping.shape == (tokens,)
                and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
                and cos.shape == sin.shape == (tokens, head_dim) and k_cache.dim() == 4
                and k_cache.shape[2] == num_kv_heads and v_cache.shape == k_cache.shape):
            raise ValueError("rope_and_write_kv takes contiguous float32 CPU tensors: qkv [tokens, (heads + 2 * "
                             "kv_heads) * head_dim], cos and sin [tokens, head_dim], caches [blocks, block_size, "
                             "kv_heads, head_dim], int64 slots [tokens]")
        slots = slot_mapping.contiguous()       # (a no-op for the runner's own slots)
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        with profiler_name(PROFILER_NAMES["rope_and_write_kv"]):
            bad = self.library.rope_and_write_kv(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                                                 k_cache.data_ptr(), v_cache.data_ptr(), tokens, num_heads,
                                                 num_kv_heads, head_dim, num_slots, torch.get_num_threads())
        if bad:
            raise bad_slots_error(bad, num_slots, slot_mapping)
        return qkv[:, :num_heads * head_dim].view(tokens, num_heads, head_dim)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for the fused ``[rows, 2 * inter]`` gate|up output."""
        if not _readable(gate_up) or gate_up.dim() != 2 or gate_up.shape[1] % 2:
            raise ValueError("silu_and_mul takes a contiguous float32 CPU tensor [rows, 2 * inter]")
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter, dtype=torch.float32)
        with profiler_name(PROFILER_NAMES["silu_and_mul"]):
            self.library.silu_and_mul(gate_up.data_ptr(), out.data_ptr(), rows, inter, torch.get_num_threads())
        return out


@functools.lru_cache(maxsize=None)
def cpu_layer_ops(head_dim: int) -> CpuLayerOps:
    """The compiled layer ops (raises CpuKernelUnavailable where the kernels cannot be built)."""
    return CpuLayerOps(head_dim)
