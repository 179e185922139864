"""The matmul floor of a step: the time its matmuls alone take, on random weights of the model's shapes.

A step can never be faster than its matmuls (fused q|k|v, o, gate|up, down per layer, and the LM head), so
``bench/decode_floor.py`` reads a decode step against this floor, and ``bench/throughput.py`` adds up the
floors of a recorded run's steps to give the run's ideal. ``linear`` chooses whose matmul code is timed: the
engine's (``linear_for`` its backend) or torch's own ``F.linear``.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from ..model.llama import lm_head_logits


def random_weights_like(model) -> tuple[list[tuple[torch.Tensor, ...]], torch.Tensor]:
    """Random matrices of the model's fused shapes: per layer (q|k|v, o, gate|up, down), and the LM head."""
    gen = torch.Generator().manual_seed(0)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen, dtype=model.dtype) * 0.02

    layers = [(weight(*w.qkv.shape), weight(*w.o.shape), weight(*w.gate_up.shape), weight(*w.down.shape))
              for w in model.layers]
    return layers, weight(*model.lm_head.shape)


def matmul_pass(model, batch: int, *, head_rows: int | None = None, weights: tuple | None = None,
                linear: Callable = F.linear) -> Callable[[], float]:
    """A function that runs one step's matmuls alone and returns its ms: ``batch`` token rows through every
    layer's 4 fused projections, and ``head_rows`` of them (default: all; 0: none) through the LM head, as a
    step that samples only some rows does. ``linear``: the engine's matmul code (``linear_for`` its
    backend: the compiled loop for a few rows on a CPU) with the LM head computed as the engine computes it
    (``lm_head_logits``), so that the floor moves with any speed-up of the matmuls themselves and the gap to
    it stays what the issue asks about, everything that is not a matmul; the default, torch's ``F.linear``,
    gives the plain torch floor. ``weights``: from ``random_weights_like``, to reuse them over many calls."""
    layers, lm_head = weights or random_weights_like(model)
    head_rows = batch if head_rows is None else head_rows
    gen = torch.Generator().manual_seed(1)
    hidden, inter = model.embed.shape[1], model.layers[0].down.shape[1]
    x = torch.randn(batch, hidden, generator=gen, dtype=model.dtype)
    mid = torch.randn(batch, inter, generator=gen, dtype=model.dtype)
    attn = torch.randn(batch, model.layers[0].o.shape[1], generator=gen, dtype=model.dtype)

    @torch.inference_mode()
    def run_once() -> float:
        start = time.perf_counter()
        for qkv, o, gate_up, down in layers:
            linear(x, qkv)
            linear(attn, o)
            linear(x, gate_up)
            linear(mid, down)
        if head_rows:
            lm_head_logits(x[:head_rows], lm_head, linear)
        return (time.perf_counter() - start) * 1000
    return run_once


def matmul_floor_ms(model, batch: int, repeats: int, *, head_rows: int | None = None,
                    weights: tuple | None = None, linear: Callable = F.linear) -> float:
    """Median ms of ``repeats`` runs of ``matmul_pass`` (after two warm-up runs)."""
    run_once = matmul_pass(model, batch, head_rows=head_rows, weights=weights, linear=linear)
    times = [run_once() for _ in range(repeats + 2)][2:]
    return statistics.median(times)
