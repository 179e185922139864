"""Every message between ranks goes through here, so it can be timed, ordered and bounded in time.

* ``all_reduce`` sums tensor-parallel partial sums **in a fixed rank order**: each rank gathers every part and
  adds them up rank 0 first, so the result is the same bits on every rank and in every run, whatever order
  a ring or tree reduction would have used (floating-point addition is not associative).
* ``send_hidden`` / ``recv_hidden`` move hidden states from one pipeline stage to the next.
* ``gather_logits`` collects the vocab-parallel logit slices to the stage's first rank, in rank order.
* Steps and commands travel from rank 0 with ``broadcast_command``.

``seconds`` accumulates the wall time spent inside these calls on this rank. On rank 0 that includes waiting
for slower ranks (a stage that is still computing), which is part of what communication costs a step.
"""
from __future__ import annotations

import pickle
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from .layout import ParallelLayout

IDLE_TIMEOUT = timedelta(days=30)


class Communicator:
    def __init__(self, layout: ParallelLayout, rank: int, timeout_s: float) -> None:
        """Call on every rank after ``init_process_group``, in the same order (creating groups is collective)."""
        self.layout, self.rank = layout, rank
        self.stage = layout.stage_of(rank)
        timeout = timedelta(seconds=timeout_s)
        world = list(range(layout.world_size))
        # Workers wait for the next command as long as the engine sits idle, so that group never times out;
        # the work of a step goes through groups whose timeout bounds how long a stuck rank can stall us.
        # Commands are small pickles, so they always go through gloo on the CPU, even beside NCCL.
        self.command_group = dist.new_group(world, timeout=IDLE_TIMEOUT, backend="gloo")
        self.timeout = timeout
        self.step_group = dist.new_group(world, timeout=timeout)
        self.tp_group = None
        for stage in range(layout.pp):
            group = dist.new_group(layout.stage_ranks(stage), timeout=timeout)
            if stage == self.stage:
                self.tp_group = group
        self.seconds = 0.0

    @contextmanager
    def timed(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start

    def broadcast_command(self, command: Optional[Any] = None) -> Any:
        """Rank 0 sends ``command`` (any picklable object, tensors on the CPU); every rank returns it.

        Workers wait for it without a time limit (the engine may sit idle for hours). Rank 0 waits at most
        the step timeout: a gloo send only completes once the receiver takes it, so a stopped worker would
        otherwise hold rank 0 forever.
        """
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(command)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        with self.timed():
            self._broadcast_from_rank0(size)
            if self.rank != 0:
                payload = torch.empty(int(size.item()), dtype=torch.uint8)
            self._broadcast_from_rank0(payload)
        return command if self.rank == 0 else pickle.loads(payload.numpy().tobytes())

    def _broadcast_from_rank0(self, tensor: torch.Tensor) -> None:
        work = dist.broadcast(tensor, src=0, group=self.command_group, async_op=True)
        if self.rank == 0:
            work.wait(timeout=self.timeout)            # raises "timed out" when a worker does not take it
        else:
            work.wait()

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum of ``partial`` over this stage's tensor-parallel ranks, added in rank order."""
        with self.timed():
            parts = [torch.empty_like(partial) for _ in range(self.layout.tp)]
            dist.all_gather(parts, partial.contiguous(), group=self.tp_group)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def gather_logits(self, logits_slice: torch.Tensor, vocab_sizes: list[int]) -> Optional[torch.Tensor]:
        """The full logits on the stage's first rank (None elsewhere). Slices may differ by one row in
        size, and gloo gathers equal shapes, so each is padded to the largest and trimmed after."""
        if self.layout.tp == 1:
            return logits_slice
        width = max(vocab_sizes)
        padded = torch.nn.functional.pad(logits_slice, (0, width - logits_slice.shape[1])).contiguous()
        first = self.layout.stage_ranks(self.stage)[0]
        parts = [torch.empty_like(padded) for _ in vocab_sizes] if self.rank == first else None
        with self.timed():
            dist.gather(padded, parts, dst=first, group=self.tp_group)
        if parts is None:
            return None
        return torch.cat([part[:, :size] for part, size in zip(parts, vocab_sizes)], dim=1)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        with self.timed():
            dist.send(tensor.contiguous(), dst, group=self.step_group)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype, device=device)
        with self.timed():
            dist.recv(buffer, src, group=self.step_group)
        return buffer
