"""The torch backend: plain torch operators on any device. It is the specification path (the other backends
refine it, op by op) and the fall-back wherever nothing faster is built or measured faster."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..cpu_argmax import torch_argmax
from ..int8 import Int8Weight, int8_linear_torch
from ..reference import TorchAttentionPlan, paged_attention_torch, plan_torch_attention, write_kv_cache
from ..torch_ops import TORCH_LAYER_OPS, vocab_sliced_linear
from .base import Backend


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, note: str = "") -> None:
        self.layer_ops = TORCH_LAYER_OPS
        self.note = note                  # why the engine is here rather than on compiled code, if it is

    def plan(self, block_tables: torch.Tensor, block_size: int, host_seq_lens: list[int],
             host_query_start_loc: list[int]) -> TorchAttentionPlan:
        return plan_torch_attention(block_tables, block_size, host_seq_lens, host_query_start_loc)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, plan: Any) -> torch.Tensor:
        return paged_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, plan=plan)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, *, all_slots_new: bool = False) -> None:
        write_kv_cache(key, value, k_cache, v_cache, slot_mapping, all_slots_new=all_slots_new)

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if isinstance(weight, Int8Weight):         # --quantization int8: widened a slice at a time (kernels/int8.py)
            return int8_linear_torch(x, weight)
        return F.linear(x, weight)

    def lm_head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if isinstance(weight, Int8Weight):
            return int8_linear_torch(x, weight)
        return vocab_sliced_linear(x, weight)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return torch_argmax(logits)

    def weight_placer(self, sizes: list[int], device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        """On a CPU, one buffer Linux may back with huge pages (``kernels/huge_pages.py``'s ``HugePageBuffer`` says why),
        filled one weight at a time; elsewhere the weights as they are."""
        from ..huge_pages import HugePageBuffer
        if torch.device(device).type != "cpu" or not HugePageBuffer.available(sizes):
            return lambda weight: weight
        return HugePageBuffer(sizes).place

    def allocate_kv_pool(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """On a CPU, memory Linux may back with huge pages (``zeros_on_huge_pages`` says why); elsewhere
        ``torch.zeros``."""
        if torch.device(device).type == "cpu":
            from ..huge_pages import zeros_on_huge_pages
            return zeros_on_huge_pages(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device)

    def describe(self, why: bool = True) -> str:
        int8 = ", int8 weights widened to float32 a slice at a time" if self.quantization else ""
        return "torch, torch ops" + int8 + (f" ({self.note})" if self.note and why else "")


TORCH_BACKEND = TorchBackend()
