"""Paged attention: a pure-torch reference (the spec), a torch path, a compiled CPU kernel and a Triton kernel.

Backends:
    triton     the GPU path (triton_paged_attention.py): every request's queries in one kernel launch.
    cpu        the CPU path the engine picks when it can: decodes by the compiled C kernel
               (cpu_paged_attention.c), reading keys and values in place; prefill chunks as in ``torch``.
               The same compiled library multiplies steps of one to seven token rows by the weights
               (cpu_matvec.c, ``linear_for``): such steps are bound by reading the weights; runs each
               layer's norms, RoPE with the K/V write, and SiLU in one call each (cpu_layer_ops.c,
               ``CpuLayerOps``); and takes greedy sampling's argmax (cpu_argmax.c, ``argmax_for``).
    torch      plain torch ops (reference.py): decodes gathered into a padded batch for
               ``scaled_dot_product_attention``, prefill chunks one by one. Runs anywhere.
    reference  the readable specification, one request at a time: tests compare the others with it.

``paged_attention`` and ``write_kv`` pick the implementation: Triton for CUDA tensors when Triton is
installed, torch otherwise (the engine asks for ``cpu`` itself when the kernel builds). Triton is imported
lazily so machines without it (Macs) never need it.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .cpu_argmax import CpuArgmax, torch_argmax
from .cpu_layer_ops import CpuLayerOps, cpu_layer_ops
from .cpu_linear import SMALL_BATCH_ROWS, SmallBatchLinear, small_batch_linear
from .cpu_paged_attention import (can_use_cpu_kernel, check_decode_inputs, cpu_kernel_available, cpu_kernel_problem,
                                  paged_decode_attention_cpu)
from .reference import (TorchAttentionPlan, paged_attention_reference, paged_attention_torch, plan_torch_attention,
                        write_kv_cache)

__all__ = ["paged_attention", "paged_attention_reference", "paged_attention_torch", "write_kv_cache",
           "write_kv", "plan_attention", "triton_available", "choose_backend", "BACKENDS",
           "paged_decode_attention_cpu", "cpu_kernel_available", "cpu_kernel_problem", "engine_backend",
           "describe_backend", "linear_for", "small_batch_linear", "SmallBatchLinear", "SMALL_BATCH_ROWS",
           "cpu_layer_ops", "CpuLayerOps", "argmax_for", "torch_argmax"]
# paged_attention_triton / write_kv_cache_triton are importable from here too (see __getattr__), but are left
# out of __all__ so that ``import *`` never pulls in Triton.

BACKENDS = ("triton", "cpu", "torch", "reference")

# Optional hints each backend understands. Callers (the model runner) may pass the hints of either backend;
# the dispatcher translates or drops the ones the chosen backend has no use for, so switching backends never
# needs a different call site.
_TORCH_HINTS = {"host_seq_lens", "host_query_start_loc", "plan"}
_TRITON_HINTS = {"max_query_len", "max_seq_len", "num_splits", "tile_n"}


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def linear_for(backend: str | None, head_dim: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The linear layer a step on ``backend`` uses: with the compiled CPU kernels ("cpu"), their small-batch
    matrix-vector loop for one to seven token rows and torch for more; anywhere else torch's ``F.linear``."""
    return small_batch_linear(head_dim) if backend == "cpu" else F.linear


def argmax_for(backend: str | None, head_dim: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Greedy sampling's argmax on ``backend``: compiled with the CPU kernels ("cpu"), torch's anywhere else."""
    return CpuArgmax(head_dim) if backend == "cpu" else torch_argmax


def choose_backend(t: torch.Tensor, backend: str | None = None, *, head_dim: int | None = None) -> str:
    """The backend to use for tensor ``t``: ``backend`` itself when given (checked), else Triton for CUDA
    tensors when Triton is installed, torch otherwise. ``head_dim``: for "cpu", the head size its compiled
    kernel must be built for; callers that only plan a step or write K/V (torch code for this backend too)
    leave it out, so that no kernel is built for a head size the model does not have."""
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


def engine_backend(device: torch.device, dtype: torch.dtype, head_dim: int, asked: str | None = None) -> str:
    """The backend an engine on ``device`` with ``dtype`` weights uses: ``asked`` when given (checked, with a
    message that says what to do instead), else Triton on CUDA when installed, the compiled kernel on a CPU
    in float32 when it builds here, torch otherwise."""
    if asked == "cpu":
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(f"the cpu attention backend runs on the CPU in float32; this engine is on {device} in "
                             f"{str(dtype).removeprefix('torch.')}: use attention_backend='torch'")
        problem = cpu_kernel_problem(head_dim)
        if problem:
            raise ValueError(f"the cpu attention backend is unavailable here: {problem}; "
                             "use attention_backend='torch'")
    if asked is not None:
        return asked
    if device.type == "cuda" and triton_available():
        return "triton"
    if device.type == "cpu" and dtype == torch.float32 and cpu_kernel_available(head_dim):
        return "cpu"
    return "torch"


def describe_backend(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                     asked: str | None = None) -> str:
    """One line for the start-up messages: which attention code runs, and why not the compiled CPU kernel
    where it would have been the choice."""
    text = {"triton": "Triton kernel", "cpu": "compiled C kernels for decodes (kernels/cpu_paged_attention.c), "
                                             "steps of 1-7 tokens (kernels/cpu_matvec.c), each layer's norms, "
                                             "RoPE and SiLU (kernels/cpu_layer_ops.c) and greedy argmax",
            "torch": "torch ops", "reference": "the one-request-at-a-time reference"}[backend]
    if backend == "torch" and asked is None and device.type == "cpu" and dtype == torch.float32:
        text += f" (the compiled CPU kernel is unavailable: {cpu_kernel_problem(head_dim)})"
    return f"{backend}, {text}"


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
        from .triton_paged_attention import paged_attention_triton
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
            hints["decode_attention"] = _checked_cpu_decode(hints, block_tables, seq_lens, query_start_loc, k_cache)
        return paged_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, **hints)
    return paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)


def _checked_cpu_decode(hints: dict[str, Any], block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, k_cache: torch.Tensor) -> Any:
    """The compiled decode kernel, its indices checked first: once per step when a plan is shared by the
    layers (the first layer checks and marks the plan), else on every call."""
    plan = hints.get("plan")
    if plan is None:
        plan = hints["plan"] = plan_torch_attention(
            block_tables, k_cache.shape[1], hints.get("host_seq_lens") or seq_lens.tolist(),
            hints.get("host_query_start_loc") or query_start_loc.tolist())
    if plan.num_decodes and not plan.decode_indices_checked:
        check_decode_inputs(plan.decode_tables, plan.decode_seq_lens, k_cache.shape[0], k_cache.shape[1])
        plan.decode_indices_checked = True
    return _CHECKED_CPU_DECODE


_CHECKED_CPU_DECODE = functools.partial(paged_decode_attention_cpu, checked=True)


def plan_attention(block_tables: torch.Tensor, block_size: int, host_seq_lens: list[int],
                   host_query_start_loc: list[int], backend: str | None = None) -> dict[str, Any]:
    """The hints for ``paged_attention`` that depend only on the step, not on the layer: worked out once per
    step and passed to every layer's call (the torch path's index tensors and masks, Triton's maxima)."""
    backend = choose_backend(block_tables, backend)
    if backend == "triton":
        return {"max_seq_len": max(host_seq_lens, default=0),
                "max_query_len": max((b - a for a, b in zip(host_query_start_loc, host_query_start_loc[1:])),
                                     default=0)}
    if backend in ("cpu", "torch"):
        return {"plan": plan_torch_attention(block_tables, block_size, host_seq_lens, host_query_start_loc)}
    return {}


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, backend: str | None = None, *, all_slots_new: bool = False) -> None:
    """Write new tokens' K/V into their cache slots (slot -1: skip) with the chosen backend.

    ``all_slots_new``: the caller knows no slot is -1 (the runner does, from its Python lists), which saves
    the torch path a check of the whole slot mapping on every layer."""
    backend = choose_backend(key, backend)
    if backend == "triton":
        from .triton_paged_attention import write_kv_cache_triton
        write_kv_cache_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        write_kv_cache(key, value, k_cache, v_cache, slot_mapping, all_slots_new=all_slots_new)


def __getattr__(name: str) -> Any:
    # ``from minipaged.kernels import paged_attention_triton`` works, but only imports Triton when asked.
    if name in ("paged_attention_triton", "write_kv_cache_triton"):
        from . import triton_paged_attention
        return getattr(triton_paged_attention, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
