"""Preemption victim: which running request gives its KV blocks up when the pool runs dry
(``--preemption-victim``).

The scheduler offers the running requests not yet scheduled this step (the request that needs room is among
them: choosing it means it waits itself). It preempts the one chosen, by recompute or swap, and asks again
until the allocation fits.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Sequence

from ..request import Request


class VictimPolicy(ABC):
    name = "custom"

    @abstractmethod
    def choose(self, candidates: Sequence[Request], num_blocks: Callable[[Request], int]) -> Request:
        """One of ``candidates`` (never empty); ``num_blocks(request)`` is how many KV blocks it holds."""


class Newest(VictimPolicy):
    """vLLM's rule: the most recently arrived request loses least work and keeps FCFS fair."""

    name = "newest"

    def choose(self, candidates: Sequence[Request], num_blocks: Callable[[Request], int]) -> Request:
        return max(candidates, key=lambda r: r.arrival_index)


class LowestPriority(VictimPolicy):
    """vLLM's victim under ``--scheduling-policy priority``: the largest ``priority`` value, newest among equals."""

    name = "lowest-priority"

    def choose(self, candidates: Sequence[Request], num_blocks: Callable[[Request], int]) -> Request:
        return max(candidates, key=lambda r: (r.params.priority, r.arrival_index))


class MostBlocks(VictimPolicy):
    """The request holding the most blocks: one preemption frees the most room (and wastes the most work)."""

    name = "most-blocks"

    def choose(self, candidates: Sequence[Request], num_blocks: Callable[[Request], int]) -> Request:
        return max(candidates, key=lambda r: (num_blocks(r), r.arrival_index))
