"""A decode step's layer loop as one compiled call (cpu_decode_layers.c): the CPU's counterpart of vLLM's CUDA
graphs. ``CompactLlama.run_layers`` is the specification, and remains what runs every other step; this replays
the same compiled kernels in the same order from C, so that a decode step of one request makes one call into C
instead of about ten per layer.

Measured on the CI machine (SmolLM2, one request, one thread, quiet): Python's loop over the compiled kernels
spent about 2 ms of a 16.7 ms fp32 step between the kernels (their wrappers, ctypes, small tensors); the file's
test checks that the two give the same logits, bit for bit. The engine option ``compiled_decode=False``
(``--no-compiled-decode``) keeps every step on the Python loop (to compare the two: bench/decode_floor.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from .build import load_kernel, profiler_name
from .cpu_layer_ops import bad_slots_error
from .cpu_linear import PER_ROW_ROWS, SMALL_BATCH_ROWS
from .cpu_paged_attention import check_plan_once
from .int8 import INT8_PER_ROW_ROWS, Int8Weight, stored_tensor

PROFILER_NAME = "minipaged::decode_layers"
WIDENING, FIXED_POINT = 1, 2            # the C file's int8_loop values (0: float32 weights)


@dataclass
class _WeightTable:
    """The addresses of a model's layer weights, as the C loop reads them, and what they were read from."""

    weights: torch.Tensor                  # [layers * 6] int64 addresses
    scales: torch.Tensor                   # [layers * 4] int64 addresses (zeros for float32)
    int8: bool


class CompiledDecodeLayers:
    """Runs ``CompactLlama.run_layers`` for a step of decodes only, one to SMALL_BATCH_ROWS rows, in one C call;
    says None for anything it does not cover (the caller then runs the Python loop). (``model`` is a CompactLlama
    and ``meta`` its AttentionMetadata: not imported, since the model imports the kernels.)"""

    def __init__(self, head_dim: int) -> None:
        self.head_dim = head_dim
        self.library = load_kernel(head_dim)
        # per model (by id): the addresses of its first and last matrices when the table was made, and the table
        self._tables: dict[int, tuple[tuple[int, int], Optional[_WeightTable]]] = {}

    def _table(self, model: Any) -> Optional[_WeightTable]:
        """The model's weight addresses, worked out once (and again only if its weights moved), or None where the C
        loop does not cover the model: it has Llama's and Mistral's layers (not Qwen's biases and q/k norms), in
        float32 or int8, each matrix laid out [out, in] as the compiled loops read it."""
        layers = model.layers
        if not layers:
            return None
        key = (stored_tensor(layers[0].qkv).data_ptr(), stored_tensor(layers[-1].down).data_ptr())
        if id(model) in self._tables and self._tables[id(model)][0] == key:
            return self._tables[id(model)][1]
        table = self._build_table(model)
        self._tables[id(model)] = (key, table)
        return table

    def _build_table(self, model: Any) -> Optional[_WeightTable]:
        layers = model.layers
        if (model.head_dim != self.head_dim or model.dtype != torch.float32
                or any(w.qkv_bias is not None or w.q_norm is not None for w in layers)):
            return None
        matrices = [m for w in layers for m in (w.qkv, w.o, w.gate_up, w.down)]
        int8 = isinstance(matrices[0], Int8Weight)
        if any(isinstance(m, Int8Weight) != int8 for m in matrices):
            return None
        # per layer, in the C loop's order: input_norm, qkv, o, post_norm, gate_up, down
        tensors = [stored_tensor(t) for w in layers
                   for t in (w.input_norm, w.qkv, w.o, w.post_norm, w.gate_up, w.down)]
        if not all(t.is_contiguous() and t.is_cpu for t in tensors):
            return None                     # (a weight stored [in, out] for torch's matmul: the loop reads [out, in])
        weights = [t.data_ptr() for t in tensors]
        scales = [m.scale.data_ptr() if int8 else 0 for m in matrices]
        return _WeightTable(torch.tensor(weights, dtype=torch.int64), torch.tensor(scales, dtype=torch.int64), int8)

    def __call__(self, model: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 meta: Any, kv_cache: torch.Tensor, plan: Any, fixed_point: bool) -> Optional[torch.Tensor]:
        """``h`` after the layers, or None where this call does not cover the step (the model's loop runs it)."""
        rows = h.shape[0]
        if not (1 <= rows <= SMALL_BATCH_ROWS and plan.num_decodes == rows and plan.decode_rows is None
                and not plan.prefills and h.dtype == torch.float32 and h.is_contiguous()
                and kv_cache.dtype == torch.float32 and kv_cache.is_contiguous()
                and kv_cache.shape[0] == len(model.layers)
                and cos.is_contiguous() and sin.is_contiguous() and meta.slot_mapping.dtype == torch.int64
                and meta.slot_mapping.is_contiguous()):
            return None
        table = self._table(model)
        if table is None:
            return None
        num_blocks, block_size = kv_cache.shape[2], kv_cache.shape[3]
        check_plan_once(plan, num_blocks, block_size)
        tables, lens = plan.decode_tables.contiguous(), plan.decode_seq_lens.contiguous()
        hidden, inter = h.shape[1], model.layers[0].gate_up.shape[0] // 2
        qkv_width = (model.num_heads + 2 * model.num_kv_heads) * self.head_dim
        scratch = torch.empty(rows * (2 * hidden + qkv_width + model.num_heads * self.head_dim + 3 * inter))
        int8_loop = (FIXED_POINT if fixed_point else WIDENING) if table.int8 else 0
        with profiler_name(PROFILER_NAME):
            result = self.library.decode_layers(
                table.weights.data_ptr(), table.scales.data_ptr(), int8_loop,
                INT8_PER_ROW_ROWS if table.int8 else PER_ROW_ROWS, kv_cache.data_ptr(), len(model.layers),
                num_blocks, block_size, h.data_ptr(), cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr(),
                tables.data_ptr(), lens.data_ptr(), tables.shape[1], scratch.data_ptr(), rows, hidden,
                model.num_heads, model.num_kv_heads, inter, model.eps, model.scale, torch.get_num_threads())
        if result < 0:
            raise MemoryError("the CPU attention kernel could not allocate its scratch memory")
        if result > 0:
            raise bad_slots_error(result, num_blocks * block_size, meta.slot_mapping)
        return h

