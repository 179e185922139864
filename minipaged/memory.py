"""Where the engine runs, in which dtype, and how many KV blocks fit there.

The KV pool is sized once, at start-up, from a memory budget: on a device that reports its free memory (CUDA)
the share of the card the engine may use minus what is already taken (vLLM's ``gpu_memory_utilization``),
elsewhere (a CPU) a number of GiB. It is never larger than every sequence at full length could use. What each
device is and has comes from ``minipaged.kernels.devices``: nothing here names a device.
"""
from __future__ import annotations

import os

import torch

from minipaged.kernels.devices import default_device, default_dtype, device_problem, free_and_total_memory

from .config import ConfigError, EngineConfig

DEFAULT_CPU_KV_GIB = 1.0
ACTIVATIONS_HEADROOM = 1.0 * 2**30        # bytes left free on a GPU for the forward pass's activations
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def choose_device(config: EngineConfig) -> torch.device:
    """CUDA when present, else the CPU; a device asked for by name must exist."""
    device = torch.device(config.device) if config.device else default_device()
    problem = device_problem(device)
    if problem:
        raise ConfigError(problem)
    return device


def apply_num_threads(config: EngineConfig) -> int:
    """Set torch's CPU thread count for the process (torch's setting is global); returns it.

    Measured on a 2-core machine (SmolLM2, 40 tokens; docs in the README): quiet, 2 threads beat 1 by 1.3x
    at batch 16 and tie at batch 1; with one other busy process, 2 threads were 2.5x *slower* than 1,
    because every matmul waits for its slowest thread. So the default leaves one core for everything else
    (the TUI's drawing, the OS, a browser): all cores but one, unless $OMP_NUM_THREADS says otherwise.
    """
    if config.num_threads == 0:
        return torch.get_num_threads()
    if config.num_threads is not None:
        chosen = config.num_threads
    elif os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        chosen = int(os.environ["OMP_NUM_THREADS"])
    else:
        chosen = max(1, (os.cpu_count() or 1) - 1)
    torch.set_num_threads(chosen)
    return chosen


def choose_dtype(config: EngineConfig, device: torch.device) -> str:
    """The dtype asked for, else the device's own default (fp32 on a CPU, bf16 on CUDA as vLLM, fp16 on a CUDA card
    without native bf16)."""
    return config.dtype or default_dtype(device)


def num_kv_blocks(config: EngineConfig, device: torch.device, bytes_per_block: int) -> int:
    """Blocks in the KV pool: ``num_blocks`` if given, else what the memory budget holds."""
    if config.num_blocks:
        return config.num_blocks
    memory = free_and_total_memory(device)
    if memory is not None:
        free, total = memory
        used_by_others = total - free
        budget = total * config.gpu_memory_utilization - used_by_others - ACTIVATIONS_HEADROOM
        if budget <= bytes_per_block:
            raise ConfigError("no GPU memory left for the KV cache; raise gpu_memory_utilization or set "
                              "num_blocks.")
    else:
        budget = (config.kv_cache_memory or DEFAULT_CPU_KV_GIB) * 2**30
    assert config.max_model_len is not None
    max_useful = config.max_num_seqs * -(-config.max_model_len // config.block_size)
    return max(1, min(int(budget // bytes_per_block), max_useful))


def num_cpu_blocks(config: EngineConfig, bytes_per_block: int) -> int:
    """Blocks in the host pool that swapped-out requests move to (none unless preemption_mode is swap)."""
    if config.preemption_mode != "swap":
        return 0
    return config.num_cpu_blocks or max(1, int(config.swap_space * 2**30 // bytes_per_block))


def return_freed_memory_to_the_os() -> None:
    """Ask glibc to give freed heap memory back to the OS (``malloc_trim``), e.g. after int8 quantization dropped
    the fp32 weights: glibc keeps large freed blocks in its heap for reuse, so the process would go on showing
    the fp32 weights' size. A no-op where the C library is not glibc (macOS, musl)."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def resident_mib() -> float:
    """This process's resident memory (Linux /proc; nan elsewhere), for start-up reports and benchmarks."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")
