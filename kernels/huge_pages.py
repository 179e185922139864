"""CPU memory that Linux may back with 2 MB pages (transparent huge pages): the KV pool and the weights.

A device specific of the CPU, so it lives with the backends that ask for it (``TorchBackend.allocate`` and
``TorchBackend.weight_placer``, the calibration's measurements); ``minipaged.bench.floor`` uses it to measure
the memory the engine really reads.
"""
from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE_BYTES = 2 * 2**20             # a transparent huge page on x86-64 and most arm64 Linux


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
