"""Where the engine runs, in which dtype, and how many KV blocks fit there.

The KV pool is sized once, at start-up, from a memory budget: on CUDA the share of the card the engine
may use minus what is already taken (vLLM's ``gpu_memory_utilization``), on a CPU a number of GiB. It is
never larger than every sequence at full length could use.
"""
from __future__ import annotations

import math
import mmap
import os

import torch

from .config import ConfigError, EngineConfig

DEFAULT_CPU_KV_GIB = 1.0
ACTIVATIONS_HEADROOM = 1.0 * 2**30        # bytes left free on a GPU for the forward pass's activations
HUGE_PAGE_BYTES = 2 * 2**20             # a transparent huge page on x86-64 and most arm64 Linux
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def choose_device(config: EngineConfig) -> torch.device:
    """CUDA when present, else the CPU; a device asked for by name must exist."""
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' was asked for, but torch sees no CUDA device here (a CPU build of "
                          "torch, or no GPU); leave device unset to use the CPU.")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device='mps' was asked for, but Apple's MPS is not available here; leave device "
                          "unset to use the CPU.")
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
    """fp32 on a CPU (exact, and fast enough there); bf16 on CUDA, as vLLM."""
    return config.dtype or ("bfloat16" if device.type == "cuda" else "float32")


def num_kv_blocks(config: EngineConfig, device: torch.device, bytes_per_block: int) -> int:
    """Blocks in the KV pool: ``num_blocks`` if given, else what the memory budget holds."""
    if config.num_blocks:
        return config.num_blocks
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
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


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor whose memory Linux may back with 2 MB pages instead of 4 KB ones.

    Why: the KV pool is read a block at a time, and each block can be anywhere in a pool of a gigabyte. With
    4 KB pages every block (12 KB for SmolLM2) needs its own page-table lookups, and the processor's cache of
    them (the TLB) covers a few MB at most, so a decode step's attention waits on page-table walks as well as
    on memory. With 2 MB pages one entry covers 170 blocks. Linux's transparent huge pages do this for
    memory that asks for it (``madvise(MADV_HUGEPAGE)``; most distributions default to "madvise"), and only
    for private anonymous memory, hence ``mmap`` here rather than torch's allocator. Measured on the CI
    machine (SmolLM2, batch 64, 138-token contexts, blocks scattered over the pool, one thread): the
    attention kernel 30.8 -> 25.5 ms over 30 layers; a whole decode step 267.8 -> 264.5 ms (batch 16:
    113.0 -> 112.2 ms). Elsewhere (macOS, Windows) this is ``torch.zeros``.
    """
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if not hasattr(mmap, "MADV_HUGEPAGE") or nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_HUGEPAGE)       # a hint: where huge pages are off, nothing changes
    pool = torch.frombuffer(memory, dtype=dtype, count=numel).view(shape)     # the tensor keeps the mapping
    pool.zero_()                             # anonymous memory reads as zeros; writing takes its pages now,
    return pool                              # at start-up, as torch.zeros did, not in the middle of a step


WEIGHT_ALIGNMENT = 64                   # bytes: a cache line, and the widest vector load


class HugePageBuffer:
    """Room for tensors of the given byte sizes, end to end (each 64-byte aligned), in one buffer whose memory
    Linux may back with 2 MB pages; ``place`` copies the next tensor in and returns the copy, with the
    tensor's shape and strides (a contiguous tensor, or the transpose of one).

    Why: a decode step of one request streams every weight from memory (SmolLM2: 540 MB in fp32), and with
    4 KB pages the processor also walks the page tables for each 4 KB it reads. One buffer rather than one
    mapping per matrix, because transparent huge pages cover only whole, aligned 2 MB stretches: most of a
    layer's matrices are smaller than that or not a multiple of it. Measured on the CI machine (SmolLM2, one
    thread, quiet): a decode step of one request 18.5 -> 16.9 ms in fp32, of 16 requests 60.5 -> 56.4 ms.
    One tensor at a time, so that a caller can let each original go as soon as its copy exists: a model's
    weights are never all held twice (TinyLlama in fp32 is 4.2 GB of them).
    """

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = [-(-size // WEIGHT_ALIGNMENT) * WEIGHT_ALIGNMENT for size in sizes]
        memory = mmap.mmap(-1, max(1, sum(self.sizes)), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        memory.madvise(mmap.MADV_HUGEPAGE)       # a hint: where huge pages are off, nothing changes
        self.buffer = torch.frombuffer(memory, dtype=torch.uint8, count=max(1, sum(self.sizes)))  # views keep it
        self.next, self.offset = 0, 0

    @staticmethod
    def available(sizes: list[int]) -> bool:
        """Worth it and possible here: Linux's madvise, and at least one huge page's worth of bytes."""
        return hasattr(mmap, "MADV_HUGEPAGE") and sum(sizes) >= HUGE_PAGE_BYTES

    def place(self, t: torch.Tensor) -> torch.Tensor:
        transposed = not t.is_contiguous()
        if transposed and not (t.dim() == 2 and t.t().is_contiguous()):
            raise ValueError(f"HugePageBuffer takes contiguous tensors or transposes of them, got strides "
                             f"{t.stride()} for shape {tuple(t.shape)}")
        if self.next >= len(self.sizes) or t.nbytes > self.sizes[self.next]:
            raise ValueError(f"tensor {self.next} ({t.nbytes} bytes) does not fit the room made for it")
        source = t.t() if transposed else t
        copy = self.buffer[self.offset:self.offset + t.nbytes].view(t.dtype).view(source.shape)
        copy.copy_(source)
        self.offset += self.sizes[self.next]
        self.next += 1
        return copy.t() if transposed else copy


def copies_on_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (CPU, each contiguous or the transpose of a contiguous tensor) in one
    ``HugePageBuffer``; where huge pages are not available (macOS, Windows, a small total), the tensors as
    they are."""
    sizes = [t.nbytes for t in tensors]
    if not HugePageBuffer.available(sizes):
        return list(tensors)
    buffer = HugePageBuffer(sizes)
    return [buffer.place(t) for t in tensors]


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
