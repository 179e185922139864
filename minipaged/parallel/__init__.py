"""Tensor and pipeline parallelism over torch.distributed: one model across processes and machines.

``layout`` says which rank holds what; ``sharding`` cuts the model; ``comm`` is every message between ranks;
``worker`` is what a non-zero rank runs; ``launch`` starts the ranks; ``distributed_runner`` is what the
engine calls instead of the single-process ``ModelRunner``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from .layout import ParallelLayout

if TYPE_CHECKING:
    import torch

    from ..model import CompactLlama, LoadedModel


def rank0_shard(model: str, layout: ParallelLayout, dtype: "torch.dtype", device: "torch.device",
                progress: Optional[Callable[[str], None]] = None) -> tuple["CompactLlama", "LoadedModel"]:
    """What the engine's own process holds under parallelism: rank 0's shard, loaded and cut on the CPU so
    that only the shard reaches ``device``, after checking that the model can be cut this way (a clear
    ConfigError naming the sizes that work, before any worker starts). Also returns the loaded model's
    tokenizer and config, its weights dropped."""
    from .sharding import load_shard
    return load_shard(model, layout, 0, dtype, device, progress)


__all__ = ["ParallelLayout", "rank0_shard"]
