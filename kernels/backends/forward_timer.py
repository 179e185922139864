"""How long a forward pass took: on the host's clock, and (on CUDA) on the device's.

Why two clocks: on a CPU the thread that calls the model computes it, so the call's wall time is the forward's
time. On CUDA the call only *launches* kernels, which the GPU runs asynchronously; the call can return long
before the GPU is done, or (when launching is the slow part: Python, hundreds of small kernels) the GPU sits
idle between kernels while the host works. The device's own time comes from CUDA events recorded on the stream
before the first kernel and after the last (``torch.cuda.Event(enable_timing=True)``), read once the step has
synchronised anyway (sampling copies the tokens to the host), so timing adds no wait.

What the events measure is the stream's span from the first kernel to the last: a gap where the GPU waited for
the next launch *inside* the forward counts as busy. It is an upper bound on the time kernels ran; the torch
profiler (bench/gpu_step.py's step_profile) counts kernels alone. With CUDA graphs (one launch for the whole
forward) the two agree closely.

The backend hands out the timer (``Backend.forward_timer``): the device choice stays in kernels/backends.
"""
from __future__ import annotations

import time
from typing import Optional

import torch


class ForwardTimer:
    """Times forward passes on the host's clock; ``device_seconds`` is None: the host computed it."""

    def __init__(self) -> None:
        self._begin = 0.0
        self.host_s = 0.0

    def start(self) -> None:
        self._begin = time.perf_counter()

    def stop(self) -> None:
        self.host_s = time.perf_counter() - self._begin

    def device_seconds(self) -> Optional[float]:
        """The device's time for the last forward pass timed; None where there is no separate device."""
        return None


class CudaForwardTimer(ForwardTimer):
    """Also records a CUDA event on the current stream at ``start`` and ``stop``; ``device_seconds`` waits for
    the second (cheap once the step has synchronised) and returns the span between them."""

    def __init__(self) -> None:
        super().__init__()
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

    def start(self) -> None:
        self._events[0].record()
        super().start()

    def stop(self) -> None:
        super().stop()
        self._events[1].record()

    def device_seconds(self) -> Optional[float]:
        begin, end = self._events
        end.synchronize()
        return begin.elapsed_time(end) / 1e3          # elapsed_time is in milliseconds


def forward_timer_for(device: torch.device) -> ForwardTimer:
    """CUDA events on a CUDA device; the host's clock anywhere else (the CPU computes the forward itself)."""
    return CudaForwardTimer() if torch.device(device).type == "cuda" else ForwardTimer()
