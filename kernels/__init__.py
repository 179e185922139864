"""Paged attention and everything else specific to a device: the backends (kernels/backends/), their kernels,
and the pure-torch specification they are tested against.

Backends (one object per engine, chosen once by ``select_backend``; see kernels/backends/base.py):
    triton     the GPU path (triton_paged_attention.py): every request's queries in one kernel launch.
    cpu        compiled C (built by build.py): decode attention (cpu_paged_attention.c), steps of one to seven
               token rows (cpu_matvec.c), each layer's norms, RoPE and SiLU (cpu_layer_ops.c), greedy argmax
               (cpu_argmax.c); each used only where it measured faster than torch here (calibration.py).
    torch      plain torch ops (reference.py, torch_ops.py): decodes gathered into a padded batch for
               ``scaled_dot_product_attention``, prefill chunks one by one. Runs anywhere.
The readable specification (reference.py, one request at a time) is no backend: tests compare each with it.
Before a backend is chosen, devices.py answers what the engine asks of a device (is it there, its default dtype,
its free memory); huge_pages.py places CPU memory on 2 MB pages.

The engine never asks for a kernel by name: it holds one ``Backend``. (Tests that call one kernel alone by a
backend's name do it through tests/kernel_dispatch.py.) Triton is imported lazily so machines without it
(Macs) never need it.
"""
from __future__ import annotations

from typing import Any

from .backends import (ALL_TORCH, Backend, CpuBackend, CpuChoice, ModelShapes, TorchBackend, TritonBackend,
                       select_backend, triton_available)
from .cpu_argmax import CpuArgmax, torch_argmax
from .cpu_layer_ops import CpuLayerOps, cpu_layer_ops
from .cpu_linear import PER_ROW_ROWS, SMALL_BATCH_ROWS, CompiledLinear, compiled_linear
from .cpu_paged_attention import (can_use_cpu_kernel, cpu_kernel_available, cpu_kernel_problem,
                                  paged_decode_attention_cpu)
from .reference import (TorchAttentionPlan, paged_attention_reference, paged_attention_torch, plan_torch_attention,
                        write_kv_cache)
from .torch_ops import TORCH_LAYER_OPS, TorchLayerOps

__all__ = ["paged_attention_reference", "paged_attention_torch", "plan_torch_attention", "write_kv_cache",
           "TorchAttentionPlan", "triton_available", "can_use_cpu_kernel",
           "paged_decode_attention_cpu", "cpu_kernel_available", "cpu_kernel_problem", "compiled_linear",
           "CompiledLinear", "SMALL_BATCH_ROWS", "PER_ROW_ROWS", "cpu_layer_ops", "CpuLayerOps", "CpuArgmax",
           "torch_argmax",
           "TorchLayerOps", "TORCH_LAYER_OPS", "Backend", "TorchBackend", "CpuBackend", "TritonBackend", "CpuChoice",
           "ALL_TORCH", "ModelShapes", "select_backend"]
# paged_attention_triton / write_kv_cache_triton are importable from here too (see __getattr__), but are left
# out of __all__ so that ``import *`` never pulls in Triton.


def __getattr__(name: str) -> Any:
    # ``from minipaged.kernels import paged_attention_triton`` works, but only imports Triton when asked.
    if name in ("paged_attention_triton", "write_kv_cache_triton"):
        from . import triton_paged_attention
        return getattr(triton_paged_attention, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
