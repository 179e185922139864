"""Paged attention: a pure-torch reference (the spec, and the CPU path) and a Triton kernel (the GPU path).

``paged_attention`` and ``write_kv`` pick the implementation: Triton for CUDA tensors when Triton is
installed, torch otherwise. Triton is imported lazily so machines without it (Macs) never need it.
"""
from __future__ import annotations

from typing import Optional

import torch

from .reference import paged_attention_reference, paged_attention_torch, write_kv_cache

__all__ = ["paged_attention", "write_kv", "paged_attention_reference", "paged_attention_torch",
           "write_kv_cache", "triton_available", "choose_backend"]


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def choose_backend(tensor: torch.Tensor, backend: Optional[str] = None) -> str:
    if backend is not None:
        return backend
    return "triton" if tensor.is_cuda and triton_available() else "torch"


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    backend: Optional[str] = None, *, host_seq_lens: Optional[list[int]] = None,
                    host_query_start_loc: Optional[list[int]] = None, **kwargs) -> torch.Tensor:
    """Attention of every scheduled query token over its request's paged context (see reference.py)."""
    if choose_backend(q, backend) == "triton":
        from .triton_paged_attention import paged_attention_triton
        if host_seq_lens is not None and host_query_start_loc is not None:
            q_lens = [b - a for a, b in zip(host_query_start_loc, host_query_start_loc[1:])]
            kwargs.setdefault("max_query_len", max(q_lens, default=1))
            kwargs.setdefault("max_seq_len", max(host_seq_lens, default=1))
        return paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                      **kwargs)
    return paged_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                 host_seq_lens=host_seq_lens, host_query_start_loc=host_query_start_loc)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, backend: Optional[str] = None) -> None:
    """Store the step's new keys and values in their cache slots."""
    if choose_backend(key, backend) == "triton":
        from .triton_paged_attention import write_kv_cache_triton
        write_kv_cache_triton(key, value, k_cache, v_cache, slot_mapping)
        return
    write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
