"""Rank 0's model runner when the model spans several processes.

It has the ``ModelRunner`` interface the engine calls (``prepare``, ``execute``, ``copy_blocks``), so the
engine does not know the model is split: ``prepare`` is the single-process one (rank 0 lays out the step);
``execute`` broadcasts the step to every rank, runs rank 0's own shard beside them and returns the logits
gathered from the last stage. Only rank 0 schedules, owns the block manager and samples.

A worker that dies, or stops answering for ``distributed_timeout`` seconds, ends the step with a
``WorkerError`` naming the rank; the runner then refuses further steps (the ranks' caches may disagree).
"""
from __future__ import annotations

import atexit
import logging
from typing import Optional

import torch
import torch.distributed as dist

from ..runner.model_runner import ModelInput, ModelRunner
from .comm import Communicator
from .launch import Workers, start_ranks
from .layout import ParallelLayout
from .sharding import ShardedLlama
from .wire import to_wire
from .worker import WorkerSpec, copy_blocks, execute_shard

logger = logging.getLogger("minipaged.parallel")


# Held strongly: an engine the caller dropped without close() still has live workers to stop.
_OPEN_RUNNERS: "set[DistributedRunner]" = set()


@atexit.register
def close_all() -> None:
    """Stop the workers of every engine still open: at exit, and from the CLI before it leaves with os._exit."""
    for runner in list(_OPEN_RUNNERS):
        runner.close()


class WorkerError(RuntimeError):
    """A worker rank died or stopped answering; the engine cannot go on."""


class DistributedRunner(ModelRunner):
    def __init__(self, model: ShardedLlama, kv_cache: torch.Tensor, cpu_kv_cache: Optional[torch.Tensor],
                 spec: WorkerSpec) -> None:
        super().__init__(model, kv_cache, spec.block_size, spec.attention_backend)
        self.cpu_kv_cache = cpu_kv_cache
        self.spec = spec
        self.layout: ParallelLayout = spec.layout
        self.timeout_s = spec.timeout_s
        self.broken: Optional[str] = None
        self.workers: Workers = start_ranks(self.layout, kv_cache.device, spec.timeout_s)
        _OPEN_RUNNERS.add(self)
        try:
            dist.broadcast_object_list([spec], src=0)
            self.comm = Communicator(self.layout, 0, spec.timeout_s)
            errors: list = [None] * self.layout.world_size
            dist.gather_object(None, errors, dst=0)      # after loading: the start-up timeout
        except Exception as exc:
            self._fail("start-up", exc)
        if any(errors):
            self.broken = "\n".join(e for e in errors if e)
            self.close(wait_s=1.0)
            raise WorkerError(self.broken)

    @property
    def counters(self) -> dict[str, float]:
        """Seconds rank 0 spent sending, receiving and waiting for other ranks (a running total)."""
        return {"communication_seconds": self.comm.seconds}

    def _check_alive(self) -> None:
        if self.broken:
            raise WorkerError(self.broken)
        if self.workers.dead():
            self._fail("the step", None)

    def _fail(self, during: str, exc: Optional[BaseException]) -> None:
        dead = self.workers.dead()
        if dead:
            what = ", ".join(f"worker rank {rank} exited (code {code})" for rank, code in dead)
        elif exc is not None and any(word in str(exc).lower() for word in ("timeout", "timed out")):
            what = f"a worker did not answer within distributed_timeout={self.timeout_s:g} s"
        else:
            what = f"communication with the workers failed ({type(exc).__name__}: {exc})"
        self.broken = (f"{what} during {during}; the engine stopped. Start a new engine "
                       f"(and look at the worker's output for why it ended).")
        self.close(wait_s=1.0)
        raise WorkerError(self.broken) from exc

    def execute(self, model_input: ModelInput) -> torch.Tensor:
        self._check_alive()
        try:
            self.comm.broadcast_command(("step", to_wire(model_input)))
            logits = execute_shard(self.model, self.comm, model_input, self.kv_cache)
        except Exception as exc:
            self._fail("a step", exc)
        assert logits is not None
        return logits

    def copy_blocks(self, src_cache: torch.Tensor, dst_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """Every rank swaps the same block ids of its own caches."""
        if not pairs:
            return
        self._check_alive()
        direction = "swap_out" if src_cache is self.kv_cache else "swap_in"
        try:
            self.comm.broadcast_command((direction, pairs))
        except Exception as exc:
            self._fail("a swap", exc)
        copy_blocks(src_cache, dst_cache, pairs)

    def close(self, wait_s: float = 5.0) -> None:
        """Tell the workers to leave, wait for them (ending any that hang), and leave the group. Safe to repeat."""
        _OPEN_RUNNERS.discard(self)
        if dist.is_initialized() and not self.broken:
            try:
                self.comm.broadcast_command(("stop",))
            except Exception:                        # a worker already gone: stopping is all we wanted
                pass
        self.workers.stop(wait_s)
        self.broken = self.broken or "this engine was closed (its workers are stopped); start a new one."
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                logger.debug("destroying the process group failed", exc_info=True)
