"""The matmul floor of a step: the time its matmuls alone take, on random weights of the model's shapes.

A step can never be faster than its matmuls (fused q|k|v, o, gate|up, down per layer, and the LM head), so
``bench/decode_floor.py`` reads a decode step against this floor, and ``bench/throughput.py`` adds up the
floors of a recorded run's steps to give the run's ideal. ``linear`` / ``lm_head`` (and the weights' layout)
choose whose matmul code is timed: the engine's backend's or torch's own.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from ..kernels.torch_ops import vocab_sliced_linear


def stored_in_out(weight: torch.Tensor) -> torch.Tensor:
    """The weight stored [in, out] (one copy), seen as its [out, in] transpose: ``F.linear`` then runs ``x @ W``."""
    return weight.t().contiguous().t()


def random_weights_like(model, prepare: Callable[[torch.Tensor], torch.Tensor] = lambda w: w,
                        prepare_lm_head: Callable[[torch.Tensor], torch.Tensor] = lambda w: w,
                        ) -> tuple[list[tuple[torch.Tensor, ...]], torch.Tensor]:
    """Random matrices of the model's fused shapes: per layer (q|k|v, o, gate|up, down), and the LM head,
    stored as ``prepare`` (a backend's ``prepare_weight``, say) and ``prepare_lm_head`` lay them out, in the
    memory the engine keeps its own weights in (``copies_on_huge_pages`` on a Linux CPU): every floor, the
    engine's and torch's, reads its weights from the same kind of memory as the engine's step does."""
    from minipaged.kernels.huge_pages import copies_on_huge_pages
    gen = torch.Generator().manual_seed(0)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen, dtype=model.dtype) * 0.02

    layers = [tuple(prepare(weight(*m.shape)) for m in (w.qkv, w.o, w.gate_up, w.down)) for w in model.layers]
    head = prepare_lm_head(weight(*model.lm_head.shape))
    if head.device.type != "cpu":
        return layers, head
    placed = copies_on_huge_pages([w for layer in layers for w in layer] + [head])
    return [tuple(placed[4 * i:4 * i + 4]) for i in range(len(layers))], placed[-1]


def matmul_pass(model, batch: int, *, head_rows: int | None = None, weights: tuple | None = None,
                linear: Callable = F.linear, lm_head: Callable = vocab_sliced_linear) -> Callable[[], float]:
    """A function that runs one step's matmuls alone and returns its ms: ``batch`` token rows through every
    layer's 4 fused projections, and ``head_rows`` of them (default: all; 0: none) through the LM head, as a
    step that samples only some rows does. ``linear`` / ``lm_head``: the engine's backend's (its matmul code:
    the compiled loop for a few rows on a CPU where it measured faster) or torch's (the defaults), so that a
    floor moves with any speed-up of the matmuls themselves and the gap to it stays everything that is not a
    matmul. ``weights``: from ``random_weights_like``, to reuse them over many calls."""
    layers, head_weight = weights or random_weights_like(model)
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
            lm_head(x[:head_rows], head_weight)
        return (time.perf_counter() - start) * 1000
    return run_once


def matmul_floor_ms(model, batch: int, repeats: int, *, head_rows: int | None = None,
                    weights: tuple | None = None, linear: Callable = F.linear,
                    lm_head: Callable = vocab_sliced_linear) -> float:
    """Median ms of ``repeats`` runs of ``matmul_pass`` (after two warm-up runs)."""
    run_once = matmul_pass(model, batch, head_rows=head_rows, weights=weights, linear=linear, lm_head=lm_head)
    times = [run_once() for _ in range(repeats + 2)][2:]
    return statistics.median(times)
