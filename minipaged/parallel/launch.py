"""Starting the ranks: spawn workers on this machine, or join ranks that ``torchrun`` started.

* Spawned (the default): rank 0, the engine's process, picks a free TCP port on 127.0.0.1 and starts
  ``world_size - 1`` worker processes with torch.multiprocessing (spawn, so each imports torch afresh).
* ``torchrun`` (one machine or several): torchrun sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
  ``MASTER_PORT`` in every process and runs the same script in each. The process with ``RANK=0`` becomes
  the engine; every other one turns into a worker when it constructs its ``Engine`` (see ``serve_torchrun_worker``).

The backend is gloo on the CPU and NCCL on CUDA, the two torch.distributed ships for these devices.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..config import ConfigError
from .layout import ParallelLayout
from .worker import serve, spawned_worker_main, start_up_timeout


def started_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it), for the rendezvous of spawned workers."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Workers:
    """Rank 0's handle on the other ranks: the processes it spawned (none under torchrun)."""

    layout: ParallelLayout
    processes: list = field(default_factory=list)

    def dead(self) -> list[tuple[int, Optional[int]]]:
        """(rank, exit code) of every spawned worker that is no longer running."""
        return [(rank, p.exitcode) for rank, p in enumerate(self.processes, 1) if not p.is_alive()]

    def stop(self, timeout_s: float = 5.0) -> None:
        """Wait for the workers to leave (after the stop command), then end any that did not."""
        for p in self.processes:
            p.join(timeout_s)
        for p in self.processes:
            if p.is_alive():
                p.terminate()
                p.join(timeout_s)
        for p in self.processes:
            if p.is_alive():
                p.kill()


def start_ranks(layout: ParallelLayout, device: torch.device, timeout_s: float) -> Workers:
    """Make this process rank 0 of a ``layout.world_size`` group; returns the workers it spawned."""
    if dist.is_initialized():
        raise ConfigError("this process already runs a parallel engine (torch.distributed has one default group "
                          "per process); close() it before starting another.")
    backend = backend_for(device)
    timeout = start_up_timeout(timeout_s)
    if started_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != layout.world_size:
            raise ConfigError(f"torchrun started {world} processes, but tensor_parallel_size x pipeline_parallel_size "
                              f"= {layout.tp} x {layout.pp} = {layout.world_size}; give torchrun "
                              f"--nnodes x --nproc-per-node = {layout.world_size}.")
        dist.init_process_group(backend, init_method="env://", rank=0, world_size=world, timeout=timeout)
        return Workers(layout)
    port = free_port()
    init_method = f"tcp://127.0.0.1:{port}"
    context = mp.get_context("spawn")
    processes = [context.Process(target=spawned_worker_main, name=f"minipaged-rank{rank}", daemon=True,
                                 args=(rank, layout.world_size, init_method, backend, timeout_s, device.type))
                 for rank in range(1, layout.world_size)]
    for p in processes:
        p.start()
    workers = Workers(layout, processes)
    try:
        dist.init_process_group(backend, init_method=init_method, rank=0, world_size=layout.world_size,
                                timeout=timeout)
    except Exception as exc:
        dead = workers.dead()
        workers.stop(1.0)
        why = (f"worker rank(s) {[rank for rank, _ in dead]} exited during start-up (their output says why; a script "
               f"that starts an engine needs `if __name__ == \"__main__\":` because spawned workers import it)"
               if dead else f"{exc}; if another program took port {port}, start again (a new one is picked)")
        raise RuntimeError(f"could not start {layout.world_size - 1} worker(s) on tcp://127.0.0.1:{port}: {why}.") from exc
    return workers


def serve_torchrun_worker() -> None:
    """Under torchrun, a process with RANK > 0: join the group and serve rank 0 until it stops."""
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    use_cuda = torch.cuda.is_available() and os.environ.get("MINIPAGED_DEVICE", "") != "cpu"
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), init_method="env://", rank=rank,
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=start_up_timeout(0))   # steps use rank 0's
    try:
        serve(rank, device)
    finally:
        dist.destroy_process_group()
