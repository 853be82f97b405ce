"""The memory meter: the truth every prediction is held to (DESIGN.md section 6).

CUDA: the caching allocator's peak above what was allocated before the call.
CPU: glibc's mmap threshold is fixed at 64 KiB so each tensor buffer is its own mapping,
returned to the kernel on free; the kernel's resident high-water mark (VmHWM) is reset
through ``/proc/self/clear_refs`` and read after the call, minus the resident size before.
That sees every allocation, compiled code included.
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable
from typing import Any

import torch

_M_MMAP_THRESHOLD = -3
_threshold_set = False


def set_mmap_threshold(nbytes: int = 65536) -> None:
    """Make glibc serve every allocation of ``nbytes`` or more with its own mapping."""
    global _threshold_set
    if _threshold_set:
        return
    libc = ctypes.CDLL("libc.so.6")
    if libc.mallopt(_M_MMAP_THRESHOLD, nbytes) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed: the CPU meter needs glibc")
    _threshold_set = True


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def resident_bytes() -> int:
    """The process's resident set size (VmRSS)."""
    return _proc_status("VmRSS")


def reset_high_water_mark() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def high_water_mark() -> int:
    return _proc_status("VmHWM")


def is_cuda(device: Any) -> bool:
    return torch.device(device).type == "cuda"


def peak_bytes(fn: Callable[[], Any], device: str | torch.device = "cpu") -> int:
    """Run ``fn()`` once and return the peak bytes it held above the level before it."""
    if is_cuda(device):
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    set_mmap_threshold()
    gc.collect()
    reset_high_water_mark()
    base = resident_bytes()
    fn()
    return int(high_water_mark() - base)


def live_bytes(device: str | torch.device = "cpu") -> int:
    """Bytes in use now: CUDA allocated bytes, or the resident set size on CPU."""
    if is_cuda(device):
        return int(torch.cuda.memory_allocated(device))
    return resident_bytes()
