"""Every rank of a layout in one process, one thread per rank: the distributed forward pass without processes.

The threads run the very same ``execute_shard`` as real ranks, with a ``ThreadCommunicator`` that moves
tensors through memory instead of gloo, summing tensor-parallel partial sums in the same rank order. So the
emulation gives the same bits as the multi-process run (a test checks it), while it can be stepped through
in a debugger, run on a laptop with any tp x pp, and read as the specification of what the ranks exchange.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Optional

import torch

from ..kernels import Backend
from ..model.llama import CompactLlama
from ..runner.model_runner import ModelInput, ModelRunner
from .layout import ParallelLayout
from .sharding import ShardedLlama
from .worker import copy_blocks, execute_shard

WAIT_S = 60.0       # a thread that waits longer for its peers means a bug in the exchange: fail, do not hang


class ThreadHub:
    """What the rank threads share: one barrier and one set of slots per tensor-parallel group, one mailbox
    per (sender, receiver) pair of pipeline neighbours."""

    def __init__(self, layout: ParallelLayout) -> None:
        self.layout = layout
        self.barriers = [threading.Barrier(layout.tp, timeout=WAIT_S) for _ in range(layout.pp)]
        self.slots: list[list[Optional[torch.Tensor]]] = [[None] * layout.tp for _ in range(layout.pp)]
        self.mailboxes: dict[tuple[int, int], queue.Queue] = {}
        self.lock = threading.Lock()

    def mailbox(self, src: int, dst: int) -> queue.Queue:
        with self.lock:
            return self.mailboxes.setdefault((src, dst), queue.Queue())


class ThreadCommunicator:
    """``Communicator``'s step operations for one rank thread (commands need none: the runner calls each
    thread directly)."""

    def __init__(self, hub: ThreadHub, rank: int) -> None:
        self.hub, self.rank, self.layout = hub, rank, hub.layout
        self.stage, self.tp_rank = hub.layout.stage_of(rank), hub.layout.tp_rank_of(rank)
        self.seconds = 0.0

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every tensor-parallel rank's ``tensor``, in rank order (an all-gather through memory)."""
        slots, barrier = self.hub.slots[self.stage], self.hub.barriers[self.stage]
        slots[self.tp_rank] = tensor
        barrier.wait()
        parts = list(slots)
        barrier.wait()                  # nobody overwrites a slot before everyone has read it
        return parts

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(partial)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def gather_logits(self, logits_slice: torch.Tensor, vocab_sizes: list[int]) -> Optional[torch.Tensor]:
        if self.layout.tp == 1:
            return logits_slice
        parts = self._exchange(logits_slice)
        return torch.cat(parts, dim=1) if self.tp_rank == 0 else None

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.hub.mailbox(self.rank, dst).put(tensor.clone())

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int) -> torch.Tensor:
        tensor = self.hub.mailbox(src, self.rank).get(timeout=WAIT_S)
        assert tensor.shape == shape and tensor.dtype == dtype, (tensor.shape, shape)
        return tensor


class EmulatedRunner(ModelRunner):
    """A ``ModelRunner`` that runs ``layout`` in threads; each rank keeps its own shard and KV cache."""

    def __init__(self, model: CompactLlama, layout: ParallelLayout, num_blocks: int, block_size: int,
                 backend: Backend) -> None:
        self.shards = [ShardedLlama(model, layout, rank) for rank in range(layout.world_size)]
        self.caches = [shard.allocate_kv_cache(num_blocks, block_size, backend=backend) for shard in self.shards]
        super().__init__(self.shards[0], self.caches[0], block_size, backend)
        self.layout = layout
        self.hub = ThreadHub(layout)
        self.comms = [ThreadCommunicator(self.hub, rank) for rank in range(layout.world_size)]

    def execute(self, model_input: ModelInput) -> torch.Tensor:
        results: list[Any] = [None] * self.layout.world_size
        errors: list[BaseException] = []

        def run(rank: int) -> None:
            try:
                results[rank] = execute_shard(self.shards[rank], self.comms[rank], model_input, self.caches[rank])
            except BaseException as exc:          # surfaced below, in the caller's thread
                errors.append(exc)
                for barrier in self.hub.barriers:
                    barrier.abort()

        threads = [threading.Thread(target=run, args=(rank,), name=f"rank{rank}")
                   for rank in range(self.layout.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results[0]

    def copy_blocks(self, src_cache: torch.Tensor, dst_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        raise NotImplementedError("the emulation keeps no CPU swap pool; use preemption_mode='recompute'.")
