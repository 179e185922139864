"""Linear layers on a CPU: torch's matmul, except for a handful of token rows, which the compiled
matrix-vector loop (cpu_matvec.c) multiplies about twice as fast.

A decode step with one to seven token rows (one request decoding, a speculative draft, a verification of a
few drafted tokens) is bound by reading the weights, not by arithmetic; cpu_matvec.c says why torch is slow
there and what was measured. Results equal ``F.linear``'s up to float rounding (the sums run in another
order), as any change of matmul kernel gives.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .build import load_kernel, profiler_name

# Up to this many token rows the compiled loop is faster than torch (measured: 1 to 7 rows faster,
# 8 rows as fast or slower; cpu_matvec.c has the figures).
SMALL_BATCH_ROWS = 7
PROFILER_NAME = "minipaged::small_batch_linear"


class SmallBatchLinear:
    """``F.linear(x, weight)``, with the compiled loop for float32 CPU inputs of at most
    ``SMALL_BATCH_ROWS`` rows (and contiguous weights); anything else goes to torch."""

    def __init__(self, head_dim: int) -> None:
        self.library = load_kernel(head_dim)      # the kernels' one shared library (built per head size)

    def handles(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        # The C loop takes the row length from the weight: an x of another width would be read past its end,
        # so a mismatch goes to torch, which raises its own error.
        # (Asked for every matmul of every step: the row count first, which settles most of them.)
        return (1 <= x.shape[0] <= SMALL_BATCH_ROWS and x.dim() == 2 and weight.dim() == 2
                and x.shape[1] == weight.shape[1] and x.dtype == weight.dtype == torch.float32
                and x.is_cpu and weight.is_cpu and weight.is_contiguous())

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not self.handles(x, weight):
            return F.linear(x, weight)
        x = x.contiguous()
        out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
        with profiler_name(PROFILER_NAME):
            self.library.small_batch_linear(weight.data_ptr(), x.data_ptr(), out.data_ptr(), x.shape[0],
                                            weight.shape[0], weight.shape[1], torch.get_num_threads())
        return out


@functools.lru_cache(maxsize=None)
def small_batch_linear(head_dim: int) -> SmallBatchLinear:
    """The compiled small-batch linear (raises CpuKernelUnavailable where the kernels cannot be built)."""
    return SmallBatchLinear(head_dim)
