"""The compiled decode attention (cpu_paged_attention.c): one query per request against its paged keys and
values, read in place. Built with the other C kernels by build.py (whose names are importable from here too).
"""
from __future__ import annotations

import torch

from .build import (COMPILE_FLAG_SETS, SOURCES, CpuKernelUnavailable, _build, _compile, _cpu_name,  # noqa: F401
                    cpu_kernel_available, cpu_kernel_problem, load_kernel, profiler_name)

PROFILER_NAME = "minipaged::paged_decode_attention_cpu"


def kernel_can_read(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The kernel reads the memory directly: float32 CPU tensors, and caches laid out contiguously. (Asked
    on every layer of every step: written out rather than as a loop, which costs a few microseconds more.)"""
    return (q.dtype == k_cache.dtype == v_cache.dtype == torch.float32 and q.is_cpu and k_cache.is_cpu
            and v_cache.is_cpu and k_cache.is_contiguous() and v_cache.is_contiguous())


def can_use_cpu_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The kernel can read these tensors and is built here for their head size."""
    return kernel_can_read(q, k_cache, v_cache) and cpu_kernel_available(q.shape[-1])


def check_decode_inputs(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int,
                        block_size: int) -> None:
    """C reads whatever address it is given: a bad block id or length would read outside the cache (or
    crash the process) instead of raising. So the indices are checked first (once per step: the plan does)."""
    if seq_lens.numel() == 0:
        return
    if int(seq_lens.min()) < 1 or int(seq_lens.max()) > block_tables.shape[1] * block_size:
        raise ValueError(f"decode lengths must be 1..{block_tables.shape[1] * block_size} (the table's blocks), "
                         f"got {seq_lens.tolist()}")
    if int(block_tables.min()) < 0 or int(block_tables.max()) >= num_blocks:
        raise ValueError(f"block ids must be 0..{num_blocks - 1}; pad short tables with any valid id")


def check_plan_once(plan, num_blocks: int, block_size: int) -> None:
    """``check_decode_inputs`` on a step's attention plan (reference.TorchAttentionPlan), once a step: every
    layer reads the same tables, so the first call checks them (the first layer's attention, or the compiled
    layer loop) and marks the plan."""
    if plan.num_decodes and not plan.decode_indices_checked:
        check_decode_inputs(plan.decode_tables, plan.decode_seq_lens, num_blocks, block_size)
        plan.decode_indices_checked = True


def paged_decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                               checked: bool = False) -> torch.Tensor:
    """Attention of one query per request over its paged keys and values, read in place.

    q [num_reqs, num_heads, head_dim]; k_cache / v_cache [num_blocks, block_size, kv_heads, head_dim];
    block_tables [num_reqs, max_blocks] (every entry a valid block id); seq_lens [num_reqs] (>= 1).
    ``checked``: the caller has already run ``check_decode_inputs`` on these tables and lengths.
    """
    num_reqs, num_heads, head_dim = q.shape
    if not kernel_can_read(q, k_cache, v_cache):
        raise ValueError("the CPU kernel reads float32 CPU tensors and contiguous K and V caches; use the torch "
                         "path for anything else")
    library = load_kernel(head_dim)
    if q.stride(2) != 1 or q.stride(1) != head_dim:       # each request's heads must lie end to end
        q = q.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    if not checked:
        check_decode_inputs(tables, lens, k_cache.shape[0], k_cache.shape[1])
    out = torch.empty(num_reqs, num_heads, head_dim, dtype=torch.float32)
    with profiler_name(PROFILER_NAME):
        failed = library.paged_decode_attention(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
            out.data_ptr(), num_reqs, num_heads, k_cache.shape[2], k_cache.shape[1], tables.shape[1], q.stride(0),
            scale, torch.get_num_threads())
    if failed:
        raise MemoryError("the CPU attention kernel could not allocate its scratch memory")
    return out
