"""Linear layers on a CPU through the compiled loops, which multiply by reading each weight once, in place:

- one to ``PER_ROW_ROWS`` token rows (one request decoding, a small verification): cpu_matvec.c, four weight
  rows at a time, one from each quarter of the matrix, against every token row; bound by reading the weights;
- more rows (a decode batch, a prefill chunk): cpu_tiled_linear.c, a register-tiled multiply that never
  repacks the weight (torch's matmul packs it on every call); 1.3x to 1.7x torch's speed on the CI machine.

Whether the compiled loops or torch run is the cpu backend's decision, by row count, from its calibration on
the machine that runs it (``kernels/backends/calibration.py``: ``few_row_linear`` for up to
``SMALL_BATCH_ROWS`` rows, ``batch_linear`` for more). Results equal ``F.linear``'s up to float rounding (the
sums run in another order), as any change of matmul kernel gives.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .build import load_kernel, profiler_name

# The row count up to which a decode step counts as "a few rows" (the calibration's few_row_linear verdict):
# one to seven rows covers one request and the verification of up to 6 drafted tokens.
SMALL_BATCH_ROWS = 7
# Up to this many rows the few-row loop runs (each token row meets four weight rows while they are in L1): on a
# Zen 2 (AVX2, one thread, SmolLM2's matrices) it took 29.9-46.7 ms at three to seven rows where the tiled one
# took 48.3-65.2, and a row's result there does not depend on the rows beside it: a verification's rows give a
# decode's logits, bit for bit.
PER_ROW_ROWS = SMALL_BATCH_ROWS
PROFILER_NAME = "minipaged::small_batch_linear"
TILED_PROFILER_NAME = "minipaged::tiled_linear"


class CompiledLinear:
    """``F.linear(x, weight)`` by the compiled loops for float32 CPU inputs (contiguous weights): the one-row
    loop for up to ``PER_ROW_ROWS`` token rows, the tiled multiply for more; anything else goes to torch."""

    def __init__(self, head_dim: int) -> None:
        self.library = load_kernel(head_dim)      # the kernels' one shared library (built per head size)

    def handles(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        # The C loops take the row length from the weight: an x of another width would be read past its end,
        # so a mismatch goes to torch, which raises its own error.
        return (x.dim() == 2 and x.shape[0] >= 1 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
                and x.dtype == weight.dtype == torch.float32 and x.is_cpu and weight.is_cpu
                and weight.is_contiguous())

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not self.handles(x, weight):
            return F.linear(x, weight)
        x = x.contiguous()
        rows = x.shape[0]
        out = torch.empty(rows, weight.shape[0], dtype=torch.float32)
        per_row = rows <= PER_ROW_ROWS
        with profiler_name(PROFILER_NAME if per_row else TILED_PROFILER_NAME):
            kernel = self.library.small_batch_linear if per_row else self.library.tiled_linear
            kernel(weight.data_ptr(), x.data_ptr(), out.data_ptr(), rows, weight.shape[0], weight.shape[1],
                   torch.get_num_threads())
        return out


@functools.lru_cache(maxsize=None)
def compiled_linear(head_dim: int) -> CompiledLinear:
    """The compiled linear (raises CpuKernelUnavailable where the kernels cannot be built)."""
    return CompiledLinear(head_dim)
