"""A worker rank: load the model, keep this rank's shard and KV cache, then run whatever rank 0 broadcasts.

Rank 0 (the engine) and every worker run the same ``execute_shard`` each step, so the one function below is
the whole distributed forward pass: receive hidden states (later stages), run this rank's layers with
all-reduces (tensor parallelism), send hidden states on (earlier stages), gather the logits to rank 0.
"""
from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..kernels import Backend
from ..parent_watch import die_with_parent
from .comm import Communicator
from .layout import ParallelLayout
from .sharding import ShardedLlama, vocab_slice
from .wire import from_wire

logger = logging.getLogger("minipaged.parallel")


START_UP_TIMEOUT_S = 300.0     # loading a model can take minutes on a busy machine


def start_up_timeout(timeout_s: float) -> timedelta:
    """The default group's timeout: it covers joining and loading, which take longer than a step."""
    return timedelta(seconds=max(timeout_s, START_UP_TIMEOUT_S))


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its shard, broadcast by rank 0 at start-up."""

    model: str
    options: dict[str, Any]                  # EngineConfig fields (dtype, num_threads, ...)
    layout: ParallelLayout
    num_blocks: int
    num_cpu_blocks: int
    block_size: int
    attention_backend: Backend               # pickled to the workers (a cpu backend travels as its verdict)
    timeout_s: float


def execute_shard(shard: ShardedLlama, comm: Communicator, model_input: Any,
                  kv_cache: torch.Tensor) -> Optional[torch.Tensor]:
    """Run this rank's part of one step; returns the logits on rank 0, None on every other rank."""
    layout, tp = shard.layout, shard.layout.tp
    num_tokens = model_input.input_ids.shape[0]
    hidden_in = None
    if not shard.is_first_stage:                              # the previous stage's output, same tp slice
        hidden_in = comm.recv((num_tokens, shard.hidden_size), shard.dtype, shard.device, src=shard.rank - tp)
    out = shard.forward_stage(model_input.input_ids, model_input.positions, model_input.meta, kv_cache,
                              model_input.logits_indices, hidden_in, comm.all_reduce if tp > 1 else None)
    num_logits = model_input.logits_indices.shape[0]
    last_stage_first_rank = layout.stage_ranks(layout.pp - 1)[0]
    if not shard.is_last_stage:
        comm.send(out, dst=shard.rank + tp)
        if shard.rank == 0:                                   # rank 0 samples: it waits for the last stage
            if num_logits == 0:
                return out.new_empty((0, shard.vocab_size), dtype=torch.float32)
            return comm.recv((num_logits, shard.vocab_size), torch.float32, shard.device, src=last_stage_first_rank)
        return None
    if num_logits == 0:                                       # a step that only fills the cache
        return out if shard.rank == 0 else None
    sizes = [len(vocab_slice(shard.vocab_size, tp, r)) for r in range(tp)]
    logits = comm.gather_logits(out, sizes)
    if shard.rank == 0 or logits is None:
        return logits
    comm.send(logits, dst=0)                                  # the last stage's first rank -> rank 0
    return None


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Swap data movement on this rank's caches (the same block ids as rank 0)."""
    src_ids = torch.tensor([s for s, _ in pairs], device=src.device)
    dst_ids = torch.tensor([d for _, d in pairs], device=dst.device)
    dst[:, :, dst_ids] = src[:, :, src_ids].to(dst.device)


def build_shard(spec: WorkerSpec, rank: int, device: torch.device) -> ShardedLlama:
    from ..config import EngineConfig
    from ..memory import DTYPES, apply_num_threads, choose_dtype
    from .sharding import load_shard

    config = EngineConfig(model=spec.model, **spec.options)
    apply_num_threads(config)
    shard, _ = load_shard(spec.model, spec.layout, rank, DTYPES[choose_dtype(config, device)], device)
    return shard


def serve(rank: int, device: torch.device) -> None:
    """The worker's life after ``init_process_group``: start-up handshake, then one command at a time."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    spec: WorkerSpec = box[0]
    comm = Communicator(spec.layout, rank, spec.timeout_s)
    error = None
    try:
        shard = build_shard(spec, rank, device)
        shard.store_weights_for(spec.attention_backend)         # the layout rank 0's backend measured fastest
        kv_cache = shard.allocate_kv_cache(spec.num_blocks, spec.block_size, backend=spec.attention_backend)
        cpu_cache = shard.allocate_kv_cache(spec.num_cpu_blocks, spec.block_size, "cpu") if spec.num_cpu_blocks else None
    except Exception as exc:                  # tell rank 0 why, instead of leaving it to time out
        error = f"rank {rank} could not load its shard: {exc!r}\n{traceback.format_exc()}"
    dist.gather_object(error, None, dst=0)
    if error:
        return
    while True:
        command = comm.broadcast_command()
        kind = command[0]
        if kind == "step":
            execute_shard(shard, comm, from_wire(command[1], device), kv_cache)
        elif kind == "swap_out":
            copy_blocks(kv_cache, cpu_cache, command[1])
        elif kind == "swap_in":
            copy_blocks(cpu_cache, kv_cache, command[1])
        elif kind == "stop":
            return


def spawned_worker_main(rank: int, world_size: int, init_method: str, backend: str, timeout_s: float,
                        device_type: str) -> None:
    """Entry point of a worker process started by rank 0 (torch.multiprocessing, spawn)."""
    die_with_parent(os.getppid())               # rank 0 killed (SIGKILL) leaves no worker behind
    device = torch.device(f"cuda:{rank}" if device_type == "cuda" else device_type)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=start_up_timeout(timeout_s))
    try:
        serve(rank, device)
    except RuntimeError as exc:                 # rank 0 went away without a stop command (killed, crashed)
        logger.error("rank %d: lost rank 0 (%s); this worker stops", rank, str(exc).splitlines()[0][:200])
        raise SystemExit(1) from None
    finally:
        dist.destroy_process_group()
