"""Building the compiled CPU kernels: the seven C files (cpu_paged_attention.c, cpu_matvec.c, cpu_int8_matvec.c,
cpu_tiled_linear.c, cpu_layer_ops.c, cpu_argmax.c, cpu_decode_layers.c) in one shared library, built on first use,
cached, loaded with ctypes. The modules that call into it (cpu_paged_attention.py, cpu_linear.py, int8.py,
cpu_layer_ops.py, cpu_argmax.py, cpu_decode_layers.py) only ask ``load_kernel``.

Why C and ctypes, not a torch C++ extension: the kernels need no torch headers, so the machine's C compiler
builds them in well under a second (a torch extension takes a minute), and the shared library lands in
minipaged's cache folder (``$MINIPAGED_CACHE``, else the user cache dir) keyed by the sources, the flags and
the CPU, so it is built once per machine. Without a working C compiler ``cpu_kernel_available`` is False, says
why in ``cpu_kernel_problem``, and the engine uses the torch backend: same results, slower decodes. To leave the
compiled kernels out on purpose, choose that backend: ``attention_backend="torch"`` (``--attention-backend torch``).
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

SOURCES = tuple(Path(__file__).with_name(name) for name in
                ("cpu_paged_attention.c", "cpu_matvec.c", "cpu_int8_matvec.c", "cpu_tiled_linear.c", "cpu_layer_ops.c",
                 "cpu_argmax.c", "cpu_decode_layers.c"))

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
    from minipaged.cache import cache_root
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
    path = _build(head_dim)
    try:
        library = ctypes.CDLL(str(path))
    except OSError:                            # a damaged file in the cache (a copy cut short, say): once more
        path = _build(head_dim, again=True)
        try:
            library = ctypes.CDLL(str(path))
        except OSError as e:
            raise CpuKernelUnavailable(f"could not load the compiled kernel {path}: {e}") from e
    signatures = {                          # name: (result, argument types)
        "paged_decode_attention": (ctypes.c_int, [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6
                                   + [ctypes.c_float, ctypes.c_int]),
        "small_batch_linear": (None, [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]),
        "int8_small_batch_linear": (None, [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]),
        "int8_fixed_point_linear": (None, [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]),
        # decode_layers(weights, scales, int8_loop, per_row_rows, kv_cache, num_layers, num_blocks, block_size, h,
        #               cos, sin, slots, block_tables, seq_lens, max_blocks, scratch, rows, hidden, num_heads,
        #               num_kv_heads, inter, eps, scale, num_threads): cpu_decode_layers.c
        "decode_layers": (ctypes.c_int64, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                                           ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 6
                          + [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 5
                          + [ctypes.c_float, ctypes.c_float, ctypes.c_int]),
        "tiled_linear": (None, [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]),
        "tiled_int8_linear": (None, [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]),
        "add_rms_norm": (None, [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int]),
        "rope_and_write_kv": (ctypes.c_int64, [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 5 + [ctypes.c_int]),
        "silu_and_mul": (None, [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]),
        "argmax_rows": (None, [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]),
    }
    for name, (result, arguments) in signatures.items():
        fn = getattr(library, name)
        fn.restype, fn.argtypes = result, arguments
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


def _profiling() -> bool:
    """Is a torch.profiler session recording? (torch keeps the flag in a private module attribute; if it
    ever goes away, every call is named, which is correct, only slower.)"""
    return getattr(torch.autograd.profiler, "_is_profiler_enabled", True)


_UNNAMED = contextlib.nullcontext()            # reusable: nothing to enter or leave


def profiler_name(name: str) -> contextlib.AbstractContextManager:
    """Name a C call for torch.profiler, which cannot see it otherwise; naming costs ~40 us, so only while a
    profiler records."""
    return record_function(name) if _profiling() else _UNNAMED


def library_identity() -> str:
    """What the compiled code depends on besides the model (CPU, compiler, flags, sources, torch): the key under
    which a calibration's verdict is cached (kernels/backends/calibration.py)."""
    compiler = _compiler() or "none"
    return hashlib.sha256(b"\0".join([*(source.read_bytes() for source in SOURCES), compiler.encode(),
                                       _cpu_name().encode(), repr(COMPILE_FLAG_SETS).encode(),
                                       torch.__version__.encode()])).hexdigest()[:16]
