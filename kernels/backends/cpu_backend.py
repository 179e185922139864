"""The cpu backend: compiled C kernels (kernels/*.c, built by kernels/build.py) for the operations a CPU runs
slowly through torch, each used only where it measured faster than torch on this machine
(``calibration.py``; the verdict is a ``CpuChoice``), torch's otherwise:

  decode attention   cpu_paged_attention.c: one query per row, keys and values read in place; a speculative
                     verification's k + 1 rows too, each as a decode seeing its context up to itself
                     (``plan``), so that a step of verifications is a decode step (and runs as one call, below);
  few-row linear     cpu_matvec.c: one to seven token rows (a decode, a speculative verification), bound by
                     reading the weights; or torch with the weights stored [in, out] where that is faster;
  batch linear       cpu_tiled_linear.c: eight rows or more (decode batches, prefill chunks), a register-tiled
                     multiply that never repacks the weights, where it beat torch's matmul;
  LM head            the same loops (few rows, and many where the batch verdict is compiled), else torch in
                     vocabulary slices;
  layer ops          cpu_layer_ops.c: norm with the residual add, RoPE with the K/V write, SiLU times up;
  argmax             cpu_argmax.c;
  a decode step      cpu_decode_layers.c: for a step of one to seven decode rows, the model's whole layer loop as
                     one call (the CPU's CUDA graph), where the whole step raced faster that way than op by op
                     (step_race.py: the verdict's ``decode_step``); it runs every op compiled, whatever the
                     per-op verdicts, which keep choosing the ops of every other step;
  int8 linear        (``--quantization int8``) cpu_int8_matvec.c and the tiled multiply for one to seven rows,
                     always (they read a quarter of fp32's bytes): for one to three rows, the one-row loop over
                     activations in fixed point or the widening one, whichever measured faster; for more, the
                     tiled multiply where it beat the weight widened a slice at a time for torch's matmul
                     (kernels/int8.py).

Prefill chunks' attention is torch's (``paged_attention_torch``) in every case.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.nn.functional as F

from .. import cpu_decode_layers
from ..cpu_argmax import CpuArgmax, torch_argmax
from ..build import _profiling
from ..cpu_layer_ops import cpu_layer_ops
from ..cpu_linear import SMALL_BATCH_ROWS, compiled_linear
from ..cpu_paged_attention import check_plan_once, kernel_can_read, paged_decode_attention_cpu
from ..int8 import Int8Linear, Int8Weight
from ..reference import TorchAttentionPlan, paged_attention_torch, plan_torch_attention
from ..torch_ops import TORCH_LAYER_OPS, vocab_sliced_linear
from .base import ModelShapes
from .calibration import COMPILED, FIXED_POINT, IN_OUT, LAYER_OPS, CpuChoice
from .torch_backend import TorchBackend

# Chunks of up to this many rows (a verification of up to seven drafts; a prompt that short) are attended row by
# row by the decode kernel: it reads a row's keys in place, where torch's attention would gather them first.
FEW_ROW_CHUNK = SMALL_BATCH_ROWS + 1

_CHECKED_DECODE = functools.partial(paged_decode_attention_cpu, checked=True)


class ChosenLayerOps:
    """Each of the three layer ops from the compiled library or from torch, as the calibration chose."""

    def __init__(self, compiled: Any, choice: CpuChoice) -> None:
        for name in LAYER_OPS:
            setattr(self, name, getattr(compiled if getattr(choice, name) == COMPILED else TORCH_LAYER_OPS, name))


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self, head_dim: int, choice: CpuChoice = CpuChoice(), source: str = "",
                 compiled_decode: bool = True) -> None:
        super().__init__()
        self.head_dim, self.choice, self.source = head_dim, choice, source
        self.compiled_decode = compiled_decode      # the engine option: False keeps decode steps on Python's loop
        compiled_ops = cpu_layer_ops(head_dim)        # raises CpuKernelUnavailable where it cannot be built
        every_op_compiled = all(getattr(choice, name) == COMPILED for name in LAYER_OPS)
        self.layer_ops = compiled_ops if every_op_compiled else ChosenLayerOps(compiled_ops, choice)
        self._matvec = compiled_linear(head_dim)
        self._int8 = Int8Linear(F.linear, head_dim, compiled=True,
                                tiled_many_rows=choice.int8_batch_linear == COMPILED,
                                fixed_point=choice.int8_one_row == FIXED_POINT)
        self._argmax = CpuArgmax(head_dim) if choice.argmax == COMPILED else torch_argmax
        # The layer loop in one call where the whole decode step raced faster so (not where each op it replays
        # won its own race: a near-tie on one op said nothing of the step); the engine option may turn it off.
        self._decode_layers = (cpu_decode_layers.CompiledDecodeLayers(head_dim)
                               if choice.decode_step == COMPILED and compiled_decode else None)

    def __reduce__(self) -> tuple:
        # Sent to tensor-parallel workers inside each step's metadata: rebuilt there from the verdict.
        return (CpuBackend, (self.head_dim, self.choice, self.source, self.compiled_decode))

    def for_shapes(self, shapes: ModelShapes) -> "CpuBackend":
        """The same verdict, with the library built for ``shapes``' head size (a draft model's may differ)."""
        return self if shapes.head_dim == self.head_dim else CpuBackend(shapes.head_dim, self.choice, self.source,
                                                                          self.compiled_decode)

    def plan(self, block_tables: torch.Tensor, block_size: int, host_seq_lens: list[int],
             host_query_start_loc: list[int]) -> TorchAttentionPlan:
        few_rows = FEW_ROW_CHUNK if self.choice.decode_attention == COMPILED else 1
        return plan_torch_attention(block_tables, block_size, host_seq_lens, host_query_start_loc, few_rows)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                  plan: TorchAttentionPlan) -> torch.Tensor:
        decode = None
        if self.choice.decode_attention == COMPILED and kernel_can_read(q, k_cache, v_cache):
            check_plan_once(plan, k_cache.shape[0], k_cache.shape[1])
            decode = _CHECKED_DECODE
        return paged_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, plan=plan,
                                     decode_attention=decode)

    def decode_layers(self, model: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: Any,
                      kv_cache: torch.Tensor, plan: TorchAttentionPlan) -> Optional[torch.Tensor]:
        compiled = self._decode_layers
        # (a profile shows the loop's parts; fp32 weights stored [in, out] for torch are not what the loop reads)
        if (compiled is not None and not _profiling()
                and (isinstance(model.layers[0].qkv, Int8Weight) or self.choice.few_row_linear != IN_OUT)):
            return compiled(model, h, cos, sin, meta, kv_cache, plan,
                            fixed_point=self.choice.int8_one_row == FIXED_POINT)
        return None

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if isinstance(weight, Int8Weight):         # --quantization int8: the int8 loop for a few rows
            return self._int8(x, weight)
        # The compiled loops take what they handle (a weight stored [out, in]) where the verdict for this many
        # rows is theirs; torch the rest.
        compiled = self._compiled_for(x.shape[0], self.choice.few_row_linear)
        return self._matvec(x, weight) if compiled else F.linear(x, weight)

    def _compiled_for(self, rows: int, few_rows_verdict: str) -> bool:
        """Whether the compiled loops won for this many token rows: ``few_rows_verdict`` up to SMALL_BATCH_ROWS
        (the layers' or the LM head's), the batch verdict beyond."""
        return (few_rows_verdict if rows <= SMALL_BATCH_ROWS else self.choice.batch_linear) == COMPILED

    def lm_head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if isinstance(weight, Int8Weight):
            return self._int8(x, weight)
        if self._compiled_for(x.shape[0], self.choice.lm_head) and self._matvec.handles(x, weight):
            return self._matvec(x, weight)
        return vocab_sliced_linear(x, weight)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return self._argmax(logits)

    def prepare_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """Stored [in, out] (one copy, seen as its [out, in] transpose) where torch's matmul measured fastest
        that way; as it came otherwise. Int8 weights stay [out, in]: the int8 loop and the widening path read
        them so (a calibration of fp32 matmuls says nothing about them)."""
        if isinstance(weight, Int8Weight):
            return weight
        if self.choice.few_row_linear == IN_OUT and weight.dim() == 2 and weight.is_contiguous():
            return weight.t().contiguous().t()
        return weight

    def describe(self, why: bool = True) -> str:
        many = ("the tiled int8 multiply" if self.choice.int8_batch_linear == COMPILED
                else "widened to float32 a slice at a time")
        one_row = "fixed point" if self.choice.int8_one_row == FIXED_POINT else "widening"
        int8 = (f"; int8 weights: compiled int8 loops for 1-7 rows (cpu_int8_matvec.c, {one_row} for 1-3; "
                f"cpu_tiled_linear.c), {many} for more" if self.quantization else "")
        one_call = ("; decode steps of 1-7 rows: the layer loop as one call (cpu_decode_layers.c)"
                    if self._decode_layers is not None else "")
        return (f"cpu, {self.choice.describe()}{int8}{one_call}"
                + (f" ({self.source})" if self.source and why else ""))
