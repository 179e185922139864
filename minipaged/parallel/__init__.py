"""Tensor and pipeline parallelism over torch.distributed: one model across processes and machines.

``layout`` says which rank holds what; ``sharding`` cuts the model; ``comm`` is every message between ranks;
``worker`` is what a non-zero rank runs; ``launch`` starts the ranks; ``distributed_runner`` is what the
engine calls instead of the single-process ``ModelRunner``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .layout import ParallelLayout

if TYPE_CHECKING:
    from ..model import CompactLlama


def rank0_model(model: "CompactLlama", layout: ParallelLayout) -> "CompactLlama":
    """What the engine's own process holds: the whole model on one rank, else rank 0's shard (after checking
    that the model can be cut this way: a clear ConfigError naming the sizes that work)."""
    layout.check(model.num_heads, model.num_kv_heads, model.layers[0].gate_up.shape[0] // 2, model.num_layers)
    if layout.world_size == 1:
        return model
    from .sharding import ShardedLlama
    return ShardedLlama(model, layout, rank=0)


__all__ = ["ParallelLayout", "rank0_model"]
