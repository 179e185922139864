"""The compiled CPU kernels, in one shared library: cpu_paged_attention.c (the decode attention),
cpu_matvec.c (small-batch matrix-vector products), cpu_layer_ops.c (a layer's norms, RoPE and K/V writes,
SiLU) and cpu_argmax.c (greedy sampling); built on first use, cached, called with ctypes.

Why C and ctypes, not a torch C++ extension: the kernel needs no torch headers, so the machine's C compiler
builds it in well under a second (a torch extension takes a minute), and the shared library lands in
minipaged's cache folder (``$MINIPAGED_CACHE``, else the user cache dir) keyed by the source, the flags and
the CPU, so it is built once per machine. Without a working C compiler (or with ``MINIPAGED_CPU_KERNEL=0``)
``cpu_kernel_available`` is False, says why in ``cpu_kernel_problem``, and the engine uses the torch path:
same results, slower decodes.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch
from torch.profiler import record_function

PROFILER_NAME = "minipaged::paged_decode_attention_cpu"
SOURCE = Path(__file__).with_name("cpu_paged_attention.c")
SOURCES = (SOURCE, *(Path(__file__).with_name(name) for name in ("cpu_matvec.c", "cpu_int8_matvec.c", "cpu_layer_ops.c", "cpu_argmax.c")))

# Tried in order: the first set the compiler accepts wins. -ffast-math lets the compiler reorder the dot
# products' sums and vectorize expf; it is given only when compiling, never when linking, because linking a
# shared library with it can switch the whole process to flush-denormals-to-zero. Compilers without OpenMP
# (Apple's clang) still build the kernel, single-threaded.
COMPILE_FLAG_SETS = (
    ["-O3", "-march=native", "-ffast-math", "-fopenmp"],
    ["-O3", "-march=native", "-ffast-math"],
    ["-O3", "-ffast-math"],
)


class CpuKernelUnavailable(RuntimeError):
    """The kernel could not be built or loaded here; the message says why and how to get it."""


def _compiler() -> Optional[str]:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_dir() -> Path:
    from minipaged.model.loader import cache_root
    return cache_root() / "kernels"


def _build(head_dim: int, *, again: bool = False) -> Path:
    """Compile the kernel for ``head_dim`` (or find it already compiled; ``again``: compile it anew); the
    path of the shared library."""
    compiler = _compiler()
    if compiler is None:
        raise CpuKernelUnavailable("no C compiler found (cc, gcc or clang); install one (Debian: apt install gcc; "
                                   "macOS: xcode-select --install) or set CC")
    identity = hashlib.sha256(b"\0".join([*(source.read_bytes() for source in SOURCES), compiler.encode(),
                                          str(head_dim).encode(),
                                          _cpu_name().encode(), repr(COMPILE_FLAG_SETS).encode()])).hexdigest()[:16]
    target = _cache_dir() / f"cpu_paged_attention-hd{head_dim}-{identity}.so"
    if target.exists() and not again:
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        return _compile(compiler, head_dim, target)
    except OSError as e:                       # a read-only or full cache folder
        raise CpuKernelUnavailable(f"cannot write the compiled kernel to {target.parent} ({e}); set "
                                   "MINIPAGED_CACHE to a writable folder") from e


def _compile(compiler: str, head_dim: int, target: Path) -> Path:
    errors = []
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects, lib = [Path(tmp) / f"{source.stem}.o" for source in SOURCES], Path(tmp) / "kernel.so"
        for flags in COMPILE_FLAG_SETS:
            openmp = ["-fopenmp"] if "-fopenmp" in flags else []
            commands = [[compiler, "-c", "-fPIC", f"-DHEAD_DIM={head_dim}", *flags, str(source), "-o", str(obj)]
                        for source, obj in zip(SOURCES, objects)]
            commands.append([compiler, "-shared", *openmp, *map(str, objects), "-o", str(lib), "-lm"])
            try:
                for command in commands:
                    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
                    if done.returncode != 0:
                        break
            except (OSError, subprocess.TimeoutExpired) as e:
                raise CpuKernelUnavailable(f"could not run the C compiler {compiler!r}: {e}") from e
            if done.returncode == 0:
                os.replace(lib, target)        # atomic: a second process building at once finds a whole file
                return target
            last_line = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            errors.append(f"[{' '.join(flags)}] {last_line}")
    raise CpuKernelUnavailable(f"{compiler} could not build {' and '.join(source.name for source in SOURCES)}: "
                               + "; ".join(errors))


@functools.lru_cache(maxsize=None)
def load_kernel(head_dim: int) -> ctypes.CDLL:
    """The compiled kernel for ``head_dim``, built on first use; raises CpuKernelUnavailable."""
    if os.environ.get("MINIPAGED_CPU_KERNEL", "1") == "0":
        raise CpuKernelUnavailable("MINIPAGED_CPU_KERNEL=0 turns the compiled CPU kernel off")
    path = _build(head_dim)
    try:
        library = ctypes.CDLL(str(path))
    except OSError:                            # a damaged file in the cache (a copy cut short, say): once more
        path = _build(head_dim, again=True)
        try:
            library = ctypes.CDLL(str(path))
        except OSError as e:
            raise CpuKernelUnavailable(f"could not load the compiled kernel {path}: {e}") from e
    fn = library.paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int]
    fn = library.small_batch_linear
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    fn = library.int8_small_batch_linear
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    fn = library.add_rms_norm
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int]
    fn = library.rope_and_write_kv
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 5 + [ctypes.c_int]
    fn = library.silu_and_mul
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    fn = library.argmax_rows
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    return library


@functools.lru_cache(maxsize=None)
def cpu_kernel_problem(head_dim: int = 64) -> Optional[str]:
    """None when the kernel for ``head_dim`` builds and loads here, else why not (one line)."""
    try:
        load_kernel(head_dim)
    except CpuKernelUnavailable as e:
        return str(e)
    return None


def cpu_kernel_available(head_dim: int = 64) -> bool:
    return cpu_kernel_problem(head_dim) is None


def kernel_can_read(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The kernel reads the memory directly: float32 CPU tensors, and caches laid out contiguously. (Asked
    on every layer of every step: written out rather than as a loop, which costs a few microseconds more.)"""
    return (q.dtype == k_cache.dtype == v_cache.dtype == torch.float32 and q.is_cpu and k_cache.is_cpu
            and v_cache.is_cpu and k_cache.is_contiguous() and v_cache.is_contiguous())


def can_use_cpu_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The kernel can read these tensors and is built here for their head size."""
    return kernel_can_read(q, k_cache, v_cache) and cpu_kernel_available(q.shape[-1])


def _profiling() -> bool:
    """Is a torch.profiler session recording? (torch keeps the flag in a private module attribute; if it
    ever goes away, every call is named, which is correct, only slower.)"""
    return getattr(torch.autograd.profiler, "_is_profiler_enabled", True)


_UNNAMED = contextlib.nullcontext()            # reusable: nothing to enter or leave


def profiler_name(name: str) -> contextlib.AbstractContextManager:
    """Name a C call for torch.profiler, which cannot see it otherwise; naming costs ~40 us, so only while a
    profiler records."""
    return record_function(name) if _profiling() else _UNNAMED


def check_decode_inputs(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int,
                        block_size: int) -> None:
    """C reads whatever address it is given: a bad block id or length would read outside the cache (or
    crash the process) instead of raising. So the indices are checked first (once per step: the plan does)."""
    if seq_lens.numel() == 0:
        return
    if int(seq_lens.min()) < 1 or int(seq_lens.max()) > block_tables.shape[1] * block_size:
        raise ValueError(f"decode lengths must be 1..{block_tables.shape[1] * block_size} (the table's blocks), "
                         f"got {seq_lens.tolist()}")
    if int(block_tables.min()) < 0 or int(block_tables.max()) >= num_blocks:
        raise ValueError(f"block ids must be 0..{num_blocks - 1}; pad short tables with any valid id")


def paged_decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                               checked: bool = False) -> torch.Tensor:
    """Attention of one query per request over its paged keys and values, read in place.

    q [num_reqs, num_heads, head_dim]; k_cache / v_cache [num_blocks, block_size, kv_heads, head_dim];
    block_tables [num_reqs, max_blocks] (every entry a valid block id); seq_lens [num_reqs] (>= 1).
    ``checked``: the caller has already run ``check_decode_inputs`` on these tables and lengths.
    """
    num_reqs, num_heads, head_dim = q.shape
    if not kernel_can_read(q, k_cache, v_cache):
        raise ValueError("the CPU kernel reads float32 CPU tensors and contiguous K and V caches; use the torch "
                         "path for anything else")
    library = load_kernel(head_dim)
    if q.stride(2) != 1 or q.stride(1) != head_dim:       # each request's heads must lie end to end
        q = q.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    if not checked:
        check_decode_inputs(tables, lens, k_cache.shape[0], k_cache.shape[1])
    out = torch.empty(num_reqs, num_heads, head_dim, dtype=torch.float32)
    with profiler_name(PROFILER_NAME):
        failed = library.paged_decode_attention(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
            out.data_ptr(), num_reqs, num_heads, k_cache.shape[2], k_cache.shape[1], tables.shape[1], q.stride(0),
            scale, torch.get_num_threads())
    if failed:
        raise MemoryError("the CPU attention kernel could not allocate its scratch memory")
    return out
