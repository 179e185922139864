"""The host pool that swapped-out requests wait in (``preemption_mode="swap"``): a plain free list of CPU
blocks, no caching. The KV cache manager moves a request's blocks here and back; the runner copies the data."""
from __future__ import annotations

from typing import Optional


class CpuBlockPool:
    """Blocks in host memory that hold swapped-out requests."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._owned: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, request_id: str, n: int) -> Optional[list[int]]:
        if n > len(self._free):
            return None
        blocks = [self._free.pop() for _ in range(n)]
        self._owned[request_id] = blocks
        return blocks

    def blocks_of(self, request_id: str) -> list[int]:
        return self._owned.get(request_id, [])

    def release(self, request_id: str) -> list[int]:
        blocks = self._owned.pop(request_id, [])
        self._free.extend(reversed(blocks))
        return blocks
