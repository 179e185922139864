"""Weight-only int8 (``--quantization int8``): each weight matrix stored as int8 with one fp32 scale per
output row, computed at load from the fp32 weights; activations, norms and the KV cache stay fp32.

Why: a decode step of one request reads every weight once and does two flops per weight, so its speed is the
speed of streaming the weights from memory. Int8 weights are a quarter of fp32's bytes. The price is
rounding: each weight moves by up to half a step (its row's largest magnitude / 254), so logits move a little
and greedy tokens can differ from fp32's: int8 is opt-in and not exact (docs/quantization.md has the figures).

Symmetric per-output-channel scales (vLLM's "per-channel" int8 weights): ``scale[i] = max_j |W[i, j]| / 127``,
``q = round(W / scale)``. A row's scale is common to all its products, so it comes out of the dot product:
``y[b, i] = scale[i] * sum_j q[i, j] * x[b, j]``.

Three ways to multiply, chosen by the number of token rows like the fp32 path (``cpu_linear.py``); the backend
owns the choice (its ``linear`` and ``lm_head`` take an ``Int8Weight`` as they take a float tensor):
- one to three rows on the cpu backend: a one-row loop (cpu_int8_matvec.c), which reads the int8 bytes once;
  it either widens them to float in registers, or (faster where the calibration found it so: ``int8_one_row``)
  multiplies them as integers by the activations written in fixed point, two int16 planes that hold them finer
  than float32 does (the C file says how, and why that is not rounding the activations);
- four to seven rows on the cpu backend, and more where its calibration found it faster than the widening
  below (``int8_batch_linear``): the tiled multiply (cpu_tiled_linear.c), which widens each int8 vector once for
  four token rows;
- otherwise (the torch backend, or a machine where torch's matmul won): the weight widened to fp32 a slice at
  a time and multiplied by torch (``int8_linear_torch``; torch's own int8-weight matmul measured far slower).
The triton backend has no int8 kernel and refuses it at start-up (``Backend.quantization_problem``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn.functional as F

from .build import load_kernel, profiler_name
from .cpu_linear import SMALL_BATCH_ROWS

if TYPE_CHECKING:
    from .backends.base import Backend

PROFILER_NAME = "minipaged::int8_small_batch_linear"
FIXED_POINT_PROFILER_NAME = "minipaged::int8_fixed_point_linear"
TILED_PROFILER_NAME = "minipaged::tiled_int8_linear"
# Up to this many token rows the one-row int8 loop beats the tiled one (measured, SmolLM2's layers: 3 rows 11.0
# vs 11.9 ms, 4 rows 14.5 vs 12.5 ms).
INT8_PER_ROW_ROWS = 3
QUANTIZATIONS = ("int8",)


@dataclass(frozen=True)
class Int8Weight:
    """A linear layer's weight in int8 with its per-row scales: what the model's linear call accepts in place
    of a float tensor when the engine quantizes."""

    qweight: torch.Tensor     # [out_features, in_features] int8, contiguous
    scale: torch.Tensor       # [out_features] float32

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scale.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight these int8 values stand for (what the rounding left of the original)."""
        return self.qweight.to(dtype) * self.scale.to(dtype)[:, None]


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-row int8 of a [out, in] weight (computed in fp32; an all-zero row gets scale 1)."""
    if weight.dim() != 2:
        raise ValueError(f"int8 quantization takes a 2-D [out, in] weight, got shape {tuple(weight.shape)}")
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return Int8Weight(q, scale.contiguous())


def stored_tensor(weight) -> torch.Tensor:
    """The tensor holding a weight's values in memory: an ``Int8Weight``'s int8 matrix, or the float tensor itself."""
    return weight.qweight if isinstance(weight, Int8Weight) else weight


def weight_bytes(tensor_or_int8) -> int:
    """Bytes a weight holds in memory, float tensor or Int8Weight."""
    if isinstance(tensor_or_int8, Int8Weight):
        return tensor_or_int8.nbytes
    return tensor_or_int8.numel() * tensor_or_int8.element_size()


# Output rows widened to fp32 at a time for more token rows than the compiled loop takes: 1024 rows of
# SmolLM2's width are 2.4 MB of floats, which stay in cache for their matmul (as in vocab_sliced_linear).
DEQUANT_SLICE_ROWS = 1024


def int8_linear_torch(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """``x @ dequantize(weight).T`` by torch: the weight widened to ``x``'s dtype ``DEQUANT_SLICE_ROWS`` output
    rows at a time, each slice multiplied while it is in cache, the scales applied to the output.

    Measured on the CI machine (busy, 2-core AMD EPYC, one thread, SmolLM2's 30 layers), fp32 ``F.linear`` ->
    this: 8 rows 87.6 -> 62.3 ms, 16 rows 116.6 -> 101.8, 64 rows 181.9 -> 163.7, 256 rows 623.9 -> 646.6 ms:
    as fast, since with many rows the arithmetic, not the weights' bytes, is the cost. torch's own int8-weight
    matmul (``torch._weight_int8pack_mm``) was 10 to 30 times slower there (16 rows: 3549 ms), so it is not used."""
    rows = weight.shape[0]
    if rows <= DEQUANT_SLICE_ROWS:
        return F.linear(x, weight.qweight.to(x.dtype)).mul_(weight.scale.to(x.dtype))
    out = torch.empty(x.shape[0], rows, dtype=x.dtype, device=x.device)
    for start in range(0, rows, DEQUANT_SLICE_ROWS):
        stop = min(start + DEQUANT_SLICE_ROWS, rows)
        torch.matmul(x, weight.qweight[start:stop].to(x.dtype).t(), out=out[:, start:stop])
    return out.mul_(weight.scale.to(x.dtype))


class Int8Linear:
    """A linear layer that takes int8 weights: ``Int8Weight`` goes to the int8 code (when ``compiled``, the cpu
    backend's: a one-row loop for up to INT8_PER_ROW_ROWS token rows, the fixed-point one when ``fixed_point``,
    else the widening one; the tiled multiply up to SMALL_BATCH_ROWS, and beyond that too when
    ``tiled_many_rows``; else, and for the rest, ``int8_linear_torch``), any float tensor to ``base`` (the fp32
    path, unchanged)."""

    def __init__(self, base: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], head_dim: int,
                 compiled: bool, tiled_many_rows: bool = False, fixed_point: bool = True) -> None:
        self.base = base
        self.library = load_kernel(head_dim) if compiled else None
        self.max_compiled_rows = None if tiled_many_rows else SMALL_BATCH_ROWS
        if self.library is not None:
            self.one_row = (self.library.int8_fixed_point_linear, FIXED_POINT_PROFILER_NAME) if fixed_point else (
                self.library.int8_small_batch_linear, PROFILER_NAME)

    def handles_compiled(self, x: torch.Tensor, weight: Int8Weight) -> bool:
        rows_ok = self.max_compiled_rows is None or x.shape[0] <= self.max_compiled_rows
        return (self.library is not None and x.dim() == 2 and x.shape[0] >= 1 and rows_ok
                and x.shape[1] == weight.shape[1] and x.dtype == torch.float32 and x.is_cpu)

    def __call__(self, x: torch.Tensor, weight) -> torch.Tensor:
        if not isinstance(weight, Int8Weight):
            return self.base(x, weight)
        if not self.handles_compiled(x, weight):
            return int8_linear_torch(x, weight)
        x = x.contiguous()
        rows = x.shape[0]
        out = torch.empty(rows, weight.shape[0], dtype=torch.float32)
        kernel, name = self.one_row if rows <= INT8_PER_ROW_ROWS else (self.library.tiled_int8_linear,
                                                                        TILED_PROFILER_NAME)
        with profiler_name(name):
            kernel(weight.qweight.data_ptr(), weight.scale.data_ptr(), x.data_ptr(), out.data_ptr(), rows,
                   weight.shape[0], weight.shape[1], torch.get_num_threads())
        return out


def quantization_problem(quantization: str, backend: "Backend", dtype: torch.dtype,
                         world_size: int) -> Optional[str]:
    """None when ``quantization`` runs with this engine's backend, dtype and parallel layout, else why not and what
    to do instead (one sentence, for a ConfigError)."""
    if quantization not in QUANTIZATIONS:
        return f"quantization must be one of {QUANTIZATIONS} (or none), got {quantization!r}"
    if world_size > 1:
        return ("quantization='int8' does not combine with tensor or pipeline parallelism yet (the shards are cut "
                "from fp32 weights); use tensor_parallel_size=1 and pipeline_parallel_size=1, or leave quantization off")
    if problem := backend.quantization_problem(quantization):
        return problem
    if dtype != torch.float32:
        return (f"quantization='int8' quantizes float32 weights and keeps activations in float32; this engine is in "
                f"{str(dtype).removeprefix('torch.')}: use dtype='float32', or leave quantization off")
    return None
