"""Whether a decode step of a few rows runs as one compiled call (cpu_decode_layers.c) or op by op: the whole
step raced both ways on the model's shapes, not read off the per-op verdicts.

The per-op verdicts still choose each op; the old rule also used them to choose the loop (every op it replays
had to win its own race), so a near-tie on one small op measured while the machine was busy (SiLU: 0.127
against 0.137 ms, then cached) turned off a loop that saves the step about 2 ms of Python between kernels. Here
the loop (``CompiledDecodeLayers``, every kernel compiled) races the per-op path the verdicts choose (the model's
own layer loop, ``CompactLlama.run_layers``, mirrored over a ``CpuBackend`` of that choice), at one row and at
four (the loop serves steps of one to seven decodes), and wins only if the two steps together take less time.

The layers are the model's shapes, as many as ``STREAM_BYTES`` holds, their weights end to end in one buffer on
huge pages as the engine places them, so that each step reads them from memory as a real step does. The step's
first and last parts (embedding, final norm, LM head) are the same both ways and are left out.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch

from ..cpu_decode_layers import CompiledDecodeLayers
from .base import ModelShapes
from .calibration import COMPILED, FEW_ROWS, IN_OUT, STREAM_BYTES, TORCH, CpuChoice, SteadyRaces, in_ms, on_huge_pages
from .cpu_backend import CpuBackend

OP = "decode_step"
PER_OP = "per op"                   # the race's other option: the model's loop, each op as the verdicts chose
CONTEXT, BLOCK_SIZE = 200, 16       # each decode's context (tokens) and the cache's block size
EPS = 1e-5


def race_decode_step(shapes: ModelShapes, choice: CpuChoice,
                     races: SteadyRaces) -> Optional[tuple[str, dict[str, dict[str, float]]]]:
    """COMPILED where the compiled layer loop's steps (one row, four rows) took less time than the per-op path's,
    TORCH otherwise, with the medians (ms) per row count; None where the loop cannot run with ``choice``
    (fp32 weights stored [in, out] for torch's matmul: the loop reads them [out, in])."""
    if choice.few_row_linear == IN_OUT:
        return None
    step = _Step(shapes, choice)
    times = {f"{OP}@{rows}": races.race(f"{OP}@{rows}", {COMPILED: step.compiled(rows), PER_OP: step.per_op(rows)})
             for rows in FEW_ROWS}
    total = {option: sum(by_option[option] for by_option in times.values()) for option in (COMPILED, PER_OP)}
    return (COMPILED if total[COMPILED] < total[PER_OP] else TORCH), in_ms(times)


class _Step:
    """A few layers of the model's shapes, a KV cache of ``FEW_ROWS[-1]`` decodes, and a step run either way."""

    def __init__(self, shapes: ModelShapes, choice: CpuChoice) -> None:
        gen = torch.Generator().manual_seed(0)
        head_dim, hidden = shapes.head_dim, shapes.hidden_size
        matrices = shapes.matrices()
        layer_floats = sum(rows * cols for rows, cols in matrices.values()) + 2 * hidden
        num_layers = max(2, STREAM_BYTES // (4 * layer_floats))
        buffer = on_huge_pages(torch.randn(num_layers * layer_floats, generator=gen) * 0.02)
        offset = 0

        def take(*shape: int) -> torch.Tensor:
            nonlocal offset
            n = shape[0] * (shape[1] if len(shape) > 1 else 1)
            tensor = buffer[offset:offset + n].view(*shape)
            offset += n
            return tensor
        layers = []
        for _ in range(num_layers):           # in the C loop's order: input_norm, qkv, o, post_norm, gate_up, down
            input_norm, qkv, o = take(hidden).fill_(1.0), take(*matrices["qkv"]), take(*matrices["o"])
            post_norm, gate_up, down = take(hidden).fill_(1.0), take(*matrices["gate_up"]), take(*matrices["down"])
            layers.append(SimpleNamespace(input_norm=input_norm, qkv=qkv, o=o, post_norm=post_norm, gate_up=gate_up,
                                          down=down, qkv_bias=None, q_norm=None))
        # what CompiledDecodeLayers reads of a CompactLlama
        self.model = SimpleNamespace(layers=layers, head_dim=head_dim, dtype=torch.float32, num_heads=shapes.num_heads,
                                     num_kv_heads=shapes.num_kv_heads, eps=EPS, scale=head_dim ** -0.5)
        rows = max(FEW_ROWS)
        blocks_each = -(-(CONTEXT + 1) // BLOCK_SIZE)
        self.kv_cache = torch.randn(num_layers, 2, rows * blocks_each, BLOCK_SIZE, shapes.num_kv_heads, head_dim,
                                    generator=gen)
        self.tables = torch.arange(rows * blocks_each, dtype=torch.int32).view(rows, blocks_each)
        self.h = torch.randn(rows, hidden, generator=gen)
        angles = torch.rand(rows, head_dim // 2, generator=gen)
        self.cos, self.sin = torch.cat([angles.cos()] * 2, -1), torch.cat([-angles.sin(), angles.sin()], -1)
        # each decode writes its new token at position CONTEXT of its own blocks
        self.slots = torch.tensor([r * blocks_each * BLOCK_SIZE + CONTEXT for r in range(rows)], dtype=torch.int64)
        self.backend = CpuBackend(head_dim, choice, compiled_decode=False)
        self.loop = CompiledDecodeLayers(head_dim)

    def _inputs(self, rows: int) -> tuple[Any, Any, torch.Tensor]:
        seq_lens, starts = [CONTEXT + 1] * rows, list(range(rows + 1))
        tables = self.tables[:rows]
        meta = SimpleNamespace(slot_mapping=self.slots[:rows].contiguous(), block_tables=tables,
                               seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                               query_start_loc=torch.tensor(starts, dtype=torch.int32), all_slots_new=True)
        plan = self.backend.plan(tables, BLOCK_SIZE, seq_lens, starts)
        return meta, plan, self.h[:rows].clone()

    def compiled(self, rows: int) -> Callable[[], torch.Tensor]:
        """The step as one call; each run returns the hidden states after the layers (tests compare them)."""
        meta, plan, h = self._inputs(rows)
        cos, sin = self.cos[:rows].contiguous(), self.sin[:rows].contiguous()

        def run() -> torch.Tensor:
            if self.loop(self.model, h.copy_(self.h[:rows]), cos, sin, meta, self.kv_cache, plan,
                         fixed_point=False) is None:
                raise RuntimeError("the compiled layer loop refused the race's decode step")
            return h
        return run

    def per_op(self, rows: int) -> Callable[[], torch.Tensor]:
        """``CompactLlama.run_layers``' loop (a Llama layer, one rank), over the backend of the per-op verdicts."""
        meta, plan, h = self._inputs(rows)
        cos, sin = self.cos[:rows], self.sin[:rows]
        model, backend = self.model, self.backend
        linear, ops = backend.linear, backend.layer_ops

        def run() -> torch.Tensor:
            h.copy_(self.h[:rows])
            mlp_out = None
            for i, w in enumerate(model.layers):
                x = ops.add_rms_norm(h, mlp_out, w.input_norm, EPS)
                qkv = linear(x, w.qkv)
                k_cache, v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
                q = ops.rope_and_write_kv(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, model.num_heads,
                                          model.num_kv_heads, all_slots_new=meta.all_slots_new)
                attn = backend.attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                         model.scale, plan)
                attn_out = linear(attn.reshape(rows, model.num_heads * model.head_dim), w.o)
                x = ops.add_rms_norm(h, attn_out, w.post_norm, EPS)
                mlp_out = linear(ops.silu_and_mul(linear(x, w.gate_up)), w.down)
            return h.add_(mlp_out)
        return run


__all__ = ["race_decode_step", "OP", "PER_OP"]
