"""Greedy sampling's argmax through the compiled library (cpu_argmax.c): the same answer as
``torch.argmax(logits, dim=-1)``, first index on ties, several times faster for a batch of rows."""
from __future__ import annotations

import torch

from .build import load_kernel, profiler_name

PROFILER_NAME = "minipaged::argmax_rows"


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy sampling's argmax as torch computes it: the sampler's default, and this kernel's fall-back."""
    return logits.argmax(dim=-1)


class CpuArgmax:
    """``torch_argmax`` for [rows, vocab] float32 CPU logits, compiled; anything else goes to torch."""

    def __init__(self, head_dim: int) -> None:
        self.library = load_kernel(head_dim)      # the kernels' one shared library (built per head size)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if not (logits.dim() == 2 and logits.shape[1] > 0 and logits.dtype == torch.float32 and logits.is_cpu):
            return torch_argmax(logits)
        logits = logits.contiguous()
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        with profiler_name(PROFILER_NAME):
            self.library.argmax_rows(logits.data_ptr(), out.data_ptr(), logits.shape[0], logits.shape[1],
                                     torch.get_num_threads())
        return out
