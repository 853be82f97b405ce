"""A step's peak bytes above what was live before it: the caching allocator's counters on
CUDA (:class:`CudaPeak`, the one reading of it), the allocation log on the CPU (the storage
meter where another profiler runs)."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_remat.measure.allocations import AllocationLog
from lightning_remat.measure.storage import StorageMeter


def step_meter(device_type: str = "cpu") -> AllocationLog | StorageMeter:
    """The CPU meter for a step: an :class:`AllocationLog`, or where another profiler is
    running a :class:`StorageMeter` (tensor storage only), after one warning."""
    if AllocationLog.available():
        return AllocationLog()
    _warn_profiler_busy()
    return StorageMeter(device_type)


_warned_busy = False


def _warn_profiler_busy() -> None:
    global _warned_busy
    if not _warned_busy:
        _warned_busy = True
        warnings.warn(
            "another torch.profiler is running, so the CPU meter counts tensor storage only: "
            "memory ops allocate inside themselves (oneDNN scratch, im2col buffers) is not "
            "seen, and plans may go over their budget. Profile and measure outside the "
            "profiler for exact figures", stacklevel=3)


StepMeter = AllocationLog | StorageMeter
"""A CPU step's meter (:func:`step_meter`)."""


def is_cuda(device: Any) -> bool:
    return torch.device(device).type == "cuda"


@contextmanager
def collector_settled(collect: bool = True) -> Iterator[None]:
    """One garbage collection, then the objects alive now out of the collector's reach
    (``gc.freeze``) until the block ends, for a block that measures many steps (the
    batch-size search, planning): the CPU meter collects garbage before every measured step
    (:func:`peak_bytes`), which with a Trainer's objects in reach takes a large part of a
    second. ``collect=False`` freezes without collecting first: garbage from before the
    block is then kept, not freed, until it ends, which is all a meter needs (nothing from
    before is freed inside a measured step) and costs nothing. Where objects are frozen
    already (the caller's own, or an enclosing block's), nothing changes: unfreezing would
    thaw them too."""
    global _settled
    # ``gc.get_freeze_count`` counts the frozen objects one by one (CPython 3.11): inside a
    # block of ours, 61 ms a call in a process holding Lightning, so it is asked only outside.
    if _settled or gc.get_freeze_count():
        yield
        return
    if collect:
        gc.collect()
    gc.freeze()
    _settled = True
    try:
        yield
    finally:
        _settled = False
        gc.unfreeze()


_settled = False
"""Whether a :func:`collector_settled` block froze the objects and runs now."""


class CudaPeak:
    """The caching allocator's peak above what was allocated at :meth:`start`, the one CUDA
    reading of a step's peak (its peak counter is reset at the start: a reading taken
    before is lost). ``synchronize``: wait for the work queued on the device at each end;
    the counters are the host's bookkeeping of what was enqueued, so a reading at a step's
    boundaries inside a training loop needs none."""

    def __init__(self, device: str | torch.device, synchronize: bool = True) -> None:
        self.device, self.synchronize, self.base = torch.device(device), synchronize, 0

    def start(self) -> None:
        if self.synchronize:
            torch.cuda.synchronize(self.device)
        self.base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def stop(self) -> int:
        """The peak bytes since :meth:`start` above what was allocated then."""
        if self.synchronize:
            torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device) - self.base)


def peak_bytes(fn: Callable[[], Any], device: str | torch.device = "cpu") -> int:
    """Run ``fn()`` once and return the peak bytes it held above the level before it."""
    if is_cuda(device):
        peak = CudaPeak(device)
        peak.start()
        fn()
        return peak.stop()
    # Garbage from before freed during fn would be never counted, never subtracted: it is
    # out of the collector's reach (frozen) while fn runs, and what was made since an
    # enclosing block froze the rest (planning's) is collected first, which costs a
    # collection of those objects only, not of every object in the process.
    with collector_settled(collect=False):
        gc.collect()
        with step_meter(torch.device(device).type) as meter:
            fn()
    return int(meter.peak)


def live_bytes(device: str | torch.device = "cpu", meter: StorageMeter | None = None) -> int:
    """Bytes in use now: CUDA allocated bytes, or on CPU the tensor storage ``meter`` has
    seen created and still alive (0 without one)."""
    if is_cuda(device):
        return int(torch.cuda.memory_allocated(device))
    return meter.live if meter is not None else 0
