"""What the engine must know of a device before it picks a backend: whether it is there, its default dtype, and
how much memory it has free. Every test of a device's type outside kernels/backends/ is here, so the engine's
sizing (minipaged/memory.py) asks questions and never names a device.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

logger = logging.getLogger("minipaged")
_SAID_FP16: set[str] = set()          # devices whose fp16 choice was said (once a process)


def default_device() -> torch.device:
    """CUDA when present, else the CPU (Apple's MPS only when asked for by name)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_problem(device: torch.device) -> Optional[str]:
    """Why the engine cannot run on ``device`` here (a sentence that says what to do instead), or None."""
    if device.type == "cuda" and not torch.cuda.is_available():
        return ("device='cuda' was asked for, but torch sees no CUDA device here (a CPU build of torch, or no "
                "GPU); leave device unset to use the CPU.")
    if device.type == "mps" and not torch.backends.mps.is_available():
        return "device='mps' was asked for, but Apple's MPS is not available here; leave device unset to use the CPU."
    return None


def default_dtype(device: torch.device) -> str:
    """fp32 on a CPU (exact, and fast enough there); bf16 on CUDA, as vLLM; fp16 on a CUDA card without native
    bf16 (compute capability below 8.0: Colab's T4, a V100), where torch would emulate bf16 slowly and Triton
    does not compile it; the engine says so once."""
    if device.type != "cuda":
        return "float32"
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return "bfloat16"
    major, minor = torch.cuda.get_device_capability(device)
    if str(device) in _SAID_FP16:
        return "float16"
    _SAID_FP16.add(str(device))
    logger.warning("%s (compute capability %d.%d) has no native bfloat16: the engine runs in float16 "
                   "(dtype='float16'; pass dtype= to choose another)", torch.cuda.get_device_name(device), major, minor)
    return "float16"


def free_and_total_memory(device: torch.device) -> Optional[tuple[int, int]]:
    """Bytes free and in all on a device whose memory other processes share and the engine sizes itself by
    (a CUDA card); None where the engine is given a budget instead (a CPU's RAM, MPS)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    return None


def use_in_this_thread(device: torch.device) -> None:
    """Make ``device`` the calling thread's current device where a device keeps one per thread: a new thread
    starts on CUDA device 0, and Triton launches on the current device. Async output processing's model thread calls
    it before its first forward pass; elsewhere there is nothing to do."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
