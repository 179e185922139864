"""Which rank holds what: the tensor-parallel x pipeline-parallel grid, checked against the model's shape.

World size = tp x pp. Rank ``r`` sits in pipeline stage ``r // tp`` and holds tensor-parallel slice
``r % tp`` of that stage's layers, so the ranks of one stage are neighbours (on one machine, in practice:
tensor parallelism talks twice per layer, pipeline parallelism once per stage). Rank 0 is stage 0, slice 0:
it also runs the scheduler, the block manager and the sampler.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def stage_of(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tp

    def stage_ranks(self, stage: int) -> list[int]:
        """The ranks that share one pipeline stage (one tensor-parallel group)."""
        return list(range(stage * self.tp, (stage + 1) * self.tp))

    def layer_range(self, num_layers: int, stage: int) -> range:
        """Consecutive layers for ``stage``; earlier stages take the one extra layer when it does not divide,
        so stage 0 (rank 0, which sizes the KV pool) holds the most."""
        base, extra = divmod(num_layers, self.pp)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (1 if stage < extra else 0))

    def check(self, num_heads: int, num_kv_heads: int, intermediate_size: int, num_layers: int) -> None:
        """A clear error for a grid the model cannot be cut into, naming the sizes that work."""
        # Each rank gets whole KV heads and the query heads that read them (a KV-head group).
        works = [d for d in divisors(num_kv_heads) if num_heads % d == 0 and intermediate_size % d == 0]
        if self.tp not in works:
            raise ConfigError(
                f"tensor_parallel_size={self.tp} does not divide this model's {num_heads} attention heads, "
                f"{num_kv_heads} KV heads and {intermediate_size} MLP columns evenly; sizes that work: "
                f"{', '.join(map(str, works))}.")
        if self.pp > num_layers:
            raise ConfigError(f"pipeline_parallel_size={self.pp} is more than the model's {num_layers} layers; "
                              f"use 1 to {num_layers}.")

    def describe(self, num_heads: int, num_kv_heads: int, num_layers: int) -> str:
        """The header text: ``tp=3: 3 heads, 1 KV head per rank``, ``pp=2: layers 0-14 | 15-29``."""
        parts = []
        if self.tp > 1:
            kv = num_kv_heads // self.tp
            parts.append(f"tp={self.tp}: {num_heads // self.tp} heads, {kv} KV head{'s' if kv > 1 else ''} per rank")
        if self.pp > 1:
            stages = " | ".join(f"{r.start}-{r.stop - 1}" for r in
                                (self.layer_range(num_layers, s) for s in range(self.pp)))
            parts.append(f"pp={self.pp}: layers {stages}")
        return ", ".join(parts) or "one rank"
