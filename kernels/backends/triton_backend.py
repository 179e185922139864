"""The triton backend: the Triton PagedAttention and K/V-write kernels (kernels/triton_paged_attention.py) and a
layer's small operations fused, one kernel each (kernels/triton_layer_ops.py: the norm with its residual add, RoPE
with the K/V write, SiLU-and-mul, greedy argmax) on CUDA; the matmuls are torch's (cuBLAS). In Triton's
interpreter (``TRITON_INTERPRET=1``) the same kernels run on CPU tensors, slowly: that is how the whole engine
is tested on this backend without a GPU (tests/test_triton_engine.py).

The fused layer ops have run only in the interpreter so far: until ``make gpu-check`` shows them exact on a GPU
they are off by default (torch's ops, as the measured GPU runs used), and the engine option ``triton_fused_ops``
(``--triton-fused-ops``) turns them on; the test suite makes them its default (``FUSED_BY_DEFAULT``, set by
tests/conftest.py), so the interpreter checks them in CI."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from .torch_backend import TorchBackend


def _write_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, *, all_slots_new: bool = False) -> None:
    from ..triton_paged_attention import write_kv_cache_triton     # Triton is imported only when used
    write_kv_cache_triton(key, value, k_cache, v_cache, slot_mapping)   # it skips -1 slots itself


FUSED_FLAG = "--triton-fused-ops"        # the engine option that turns the fused layer ops on
FUSED_BY_DEFAULT = False                 # what fused=None means; the test suite's conftest sets True


class TritonBackend(TorchBackend):
    name = "triton"

    def __init__(self, fused: Optional[bool] = None) -> None:
        super().__init__()
        self.fused = FUSED_BY_DEFAULT if fused is None else fused
        self._argmax = super().argmax
        if self.fused:
            from ..triton_layer_ops import TritonLayerOps, triton_argmax     # Triton is imported only when used
            self.layer_ops = TritonLayerOps()
            self._argmax = triton_argmax

    def plan(self, block_tables: torch.Tensor, block_size: int, host_seq_lens: list[int],
             host_query_start_loc: list[int]) -> dict[str, int]:
        """The step's longest context and longest query, known on the host: no device sync to find them."""
        return {"max_seq_len": max(host_seq_lens, default=0),
                "max_query_len": max((b - a for a, b in zip(host_query_start_loc, host_query_start_loc[1:])),
                                     default=0)}

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, plan: Any) -> torch.Tensor:
        from ..triton_paged_attention import paged_attention_triton
        return paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, **plan)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, *, all_slots_new: bool = False) -> None:
        _write_kv_triton(key, value, k_cache, v_cache, slot_mapping)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return self._argmax(logits)

    def lm_head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)

    def quantization_problem(self, quantization: str) -> Optional[str]:
        return (f"quantization={quantization!r} has no Triton kernel: the triton backend refuses it; use "
                "attention_backend='torch' (or the CPU), or leave quantization off")

    def cuda_graphs_problem(self, device: torch.device) -> Optional[str]:
        """The Triton attention reads every per-step value from device tensors; its host-side hints (the longest
        context, one query per row) are fixed per captured size (cuda_graphs.py). Real graphs need CUDA."""
        if torch.device(device).type != "cuda":
            return (f"CUDA graphs need a CUDA device (this engine is on {device}): leave cuda_graphs off, or pass "
                    "--enforce-eager")
        return None

    def describe(self, why: bool = True) -> str:
        ops = ("fused layer ops (kernels/triton_layer_ops.py)" if self.fused else
               f"torch's layer ops ({FUSED_FLAG}: the fused ones, not yet checked on a GPU)")
        return f"triton, Triton kernels for attention (kernels/triton_paged_attention.py), {ops}, torch matmuls"
