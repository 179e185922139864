"""One ``Backend`` object per engine, chosen once by ``select_backend``: torch (the specification, any
device), cpu (compiled C, each op where it measured faster), triton (CUDA, or Triton's interpreter).

Their names are spelled once, in ``minipaged.config.AttentionBackend``: the flags, ``EngineConfig.validate``
and ``select_backend`` all read that list, and it lives there because the options must be known without
importing torch (a thin client builds no engine)."""
from __future__ import annotations

import functools
import os
from typing import Optional, get_args

import torch

from minipaged.config import AttentionBackend

from ..build import cpu_kernel_problem
from .base import Backend, ModelShapes
from .calibration import ALL_TORCH, COMPILED, IN_OUT, TORCH, CpuChoice, Timer, calibrated_choice
from .cpu_backend import CpuBackend
from .step_race import race_decode_step
from .torch_backend import TORCH_BACKEND, TorchBackend
from .triton_backend import TritonBackend

__all__ = ["Backend", "ModelShapes", "TorchBackend", "CpuBackend", "TritonBackend", "TORCH_BACKEND", "CpuChoice",
           "ALL_TORCH", "COMPILED", "TORCH", "IN_OUT", "select_backend", "cpu_backend_for", "triton_available",
           "BACKEND_NAMES"]

BACKEND_NAMES: tuple[str, ...] = get_args(AttentionBackend)


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def cpu_backend_for(shapes: ModelShapes, timer: Optional[Timer] = None, cpu_ops: Optional[str] = None,
                    compiled_decode: bool = True, remeasure: bool = False,
                    record: Optional[dict] = None) -> CpuBackend:
    """The cpu backend for a model of ``shapes``, each op from the side that measured faster here (or from the
    side ``cpu_ops`` names), and the decode step's layer loop one call where the whole step measured faster so.
    ``remeasure``: measure again even where a verdict is cached, and cache the new one; ``record``: filled with
    the medians measured (both for ``bench calibrate``)."""
    choice, source = calibrated_choice(shapes, shapes.head_dim, timer, cpu_ops,
                                       step_race=lambda choice, races: race_decode_step(shapes, choice, races),
                                       remeasure=remeasure, record=record)
    return CpuBackend(shapes.head_dim, choice, source, compiled_decode)


def select_backend(device: torch.device, dtype: torch.dtype, shapes: ModelShapes, asked: Optional[str] = None,
                   timer: Optional[Timer] = None, *, cpu_ops: Optional[str] = None, compiled_decode: bool = True,
                   triton_fused_ops: Optional[bool] = None) -> Backend:
    """The backend of an engine on ``device`` with ``dtype`` weights: ``asked`` when given (checked, with a
    message that says what to do instead), else Triton on CUDA when installed, the compiled kernels on a CPU
    in float32 when they build here, torch otherwise. The keyword options are the engine's switches of one
    backend's code paths (``EngineConfig``'s fields of the same names), ignored by the others. Raises
    ValueError."""
    device = torch.device(device)
    problem = lambda: cpu_kernel_problem(shapes.head_dim)      # noqa: E731  (builds the kernels: ask only when needed)
    if asked not in (None, *BACKEND_NAMES):
        raise ValueError(f"unknown attention backend {asked!r}; choose one of {BACKEND_NAMES}")
    if asked == "triton" or (asked is None and device.type == "cuda" and triton_available()):
        if not triton_available():
            raise ValueError("the triton attention backend needs Triton: pip install 'minipaged[gpu]' (Linux with a "
                             "CUDA GPU), or use attention_backend='torch'.")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"the triton attention backend runs on CUDA (this engine is on {device}), or on the CPU "
                             "in Triton's interpreter (TRITON_INTERPRET=1, slow); use attention_backend='torch'")
        return TritonBackend(triton_fused_ops)
    cpu_float32 = device.type == "cpu" and dtype == torch.float32
    if asked == "cpu":
        if not cpu_float32:
            raise ValueError(f"the cpu attention backend runs on the CPU in float32; this engine is on {device} in "
                             f"{str(dtype).removeprefix('torch.')}: use attention_backend='torch'")
        if problem():
            raise ValueError(f"the cpu attention backend is unavailable here: {problem()}; "
                             "use attention_backend='torch'")
    if asked == "cpu" or (asked is None and cpu_float32 and problem() is None):
        return cpu_backend_for(shapes, timer, cpu_ops, compiled_decode)
    if asked is None and cpu_float32:
        return TorchBackend(note=f"the compiled CPU kernel is unavailable: {problem()}")
    return TorchBackend()
