"""One kernel alone, chosen by a backend's name: the tests' and benchmarks' way to call an attention op without an
engine (the engine holds one ``Backend`` object, chosen once by ``select_backend``, and never asks by name).

``paged_attention``, ``plan_attention`` and ``write_kv`` are the same operations as functions of a backend's
name: "triton", "cpu", "torch" (the names the engine knows) or "reference" (the readable specification,
one request at a time). Triton is imported only when asked for.
"""
from __future__ import annotations

import functools
from typing import Any, get_args

import torch

from minipaged.config import AttentionBackend
from minipaged.kernels import (CpuBackend, CpuChoice, can_use_cpu_kernel, cpu_kernel_available, cpu_kernel_problem,
                               paged_attention_reference, paged_attention_torch, plan_torch_attention,
                               triton_available, write_kv_cache)
from minipaged.kernels.backends.cpu_backend import FEW_ROW_CHUNK

BACKENDS = (*get_args(AttentionBackend), "reference")

# Optional hints each backend understands. Callers may pass the hints of either; the dispatcher translates or
# drops the ones the chosen backend has no use for, so switching backends never needs a different call site.
_TORCH_HINTS = {"host_seq_lens", "host_query_start_loc", "plan"}
_TRITON_HINTS = {"max_query_len", "max_seq_len", "num_splits", "tile_n"}


def choose_backend(t: torch.Tensor, backend: str | None = None, *, head_dim: int | None = None) -> str:
    """The backend to use for tensor ``t``: ``backend`` itself when given (checked), else Triton for CUDA
    tensors when Triton is installed, torch otherwise. ``head_dim``: for "cpu", the head size its compiled
    kernel must be built for; callers that only plan a step or write K/V leave it out."""
    if backend is None:
        return "triton" if t.is_cuda and triton_available() else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    if backend == "triton" and not triton_available():
        raise ValueError("the triton attention backend needs Triton: pip install 'minipaged[gpu]' (Linux with a "
                         "CUDA GPU), or use the torch backend.")
    if backend == "cpu" and head_dim is not None and not cpu_kernel_available(head_dim):
        raise ValueError(f"the cpu attention backend needs its compiled kernel, which is unavailable here "
                         f"({cpu_kernel_problem(head_dim)}); use the torch backend.")
    return backend


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    backend: str | None = None, **kw: Any) -> torch.Tensor:
    """Attention over the paged KV cache with the chosen backend (None: Triton on CUDA, else torch).

    Extra keyword hints: ``host_seq_lens`` / ``host_query_start_loc`` (Python lists, saves syncs; the
    Triton path derives ``max_seq_len`` / ``max_query_len`` from them),
    ``max_query_len`` / ``max_seq_len`` / ``num_splits`` / ``tile_n`` (Triton path).
    """
    unknown = set(kw) - _TORCH_HINTS - _TRITON_HINTS
    if unknown:
        raise TypeError(f"paged_attention() got unexpected keyword arguments {sorted(unknown)}")
    backend = choose_backend(q, backend, head_dim=q.shape[-1])
    if backend == "triton":
        from minipaged.kernels.triton_paged_attention import paged_attention_triton
        hints = {k: v for k, v in kw.items() if k in _TRITON_HINTS}
        host_seq_lens, host_starts = kw.get("host_seq_lens"), kw.get("host_query_start_loc")
        if host_seq_lens is not None and "max_seq_len" not in hints:
            hints["max_seq_len"] = max(host_seq_lens, default=0)
        if host_starts is not None and "max_query_len" not in hints:
            hints["max_query_len"] = max((b - a for a, b in zip(host_starts, host_starts[1:])), default=0)
        return paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                      **hints)
    if backend in ("cpu", "torch"):
        hints = {k: v for k, v in kw.items() if k in _TORCH_HINTS}
        if backend == "cpu" and can_use_cpu_kernel(q, k_cache, v_cache):
            cpu = _compiled_cpu_backend(q.shape[-1])
            plan = hints.get("plan") or cpu.plan(
                block_tables, k_cache.shape[1], hints.get("host_seq_lens") or seq_lens.tolist(),
                hints.get("host_query_start_loc") or query_start_loc.tolist())
            return cpu.attention(q, k_cache, v_cache, block_tables, seq_lens,
                                                                query_start_loc, scale, plan)
        return paged_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, **hints)
    return paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)


@functools.lru_cache(maxsize=None)
def _compiled_cpu_backend(head_dim: int) -> CpuBackend:
    """The cpu backend with every compiled op, for calls by name (no calibration: these callers ask for C)."""
    return CpuBackend(head_dim, CpuChoice())


def plan_attention(block_tables: torch.Tensor, block_size: int, host_seq_lens: list[int],
                   host_query_start_loc: list[int], backend: str | None = None) -> dict[str, Any]:
    """The hints for ``paged_attention`` that depend only on the step, not on the layer: worked out once per
    step and passed to every layer's call (the torch path's index tensors and masks, Triton's maxima)."""
    backend = choose_backend(block_tables, backend)
    if backend == "triton":
        return {"max_seq_len": max(host_seq_lens, default=0),
                "max_query_len": max((b - a for a, b in zip(host_query_start_loc, host_query_start_loc[1:])),
                                     default=0)}
    if backend in ("cpu", "torch"):      # (the cpu backend's plan attends chunks of a few rows as decodes)
        few_rows = FEW_ROW_CHUNK if backend == "cpu" else 1
        return {"plan": plan_torch_attention(block_tables, block_size, host_seq_lens, host_query_start_loc,
                                             few_rows)}
    return {}


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, backend: str | None = None, *, all_slots_new: bool = False) -> None:
    """Write new tokens' K/V into their cache slots (slot -1: skip) with the chosen backend."""
    backend = choose_backend(key, backend)
    if backend == "triton":
        from minipaged.kernels.triton_paged_attention import write_kv_cache_triton
        write_kv_cache_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        write_kv_cache(key, value, k_cache, v_cache, slot_mapping, all_slots_new=all_slots_new)
