"""The memory meter: the truth every prediction is held to (docs/design.md section 6).

CUDA: the caching allocator's peak above what was allocated before the call.
CPU: every allocation c10's CPU allocator makes (:class:`AllocationLog`): the autograd
profiler's memory events (without Kineto), which c10 reports for each allocation and free
with its size, op-internal buffers included (a oneDNN convolution's scratch, im2col's column
buffers), read back after the call. It changes nothing in the process (no allocator
setting, no ``/proc`` write). Where another torch.profiler is running (one at a time), the
meter counts tensor storage instead (:class:`StorageMeter`, the way
``torch.distributed._tools.mem_tracker`` counts), which sees every tensor but no op's
internal scratch, and says so once.

Here the allocation log; the storage meter is :mod:`.storage`, the choice between them and a
step's peak :mod:`.peak`, the op-by-op timeline :mod:`.timeline`.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.autograd import (
    ProfilerConfig,
    ProfilerState,
    _disable_profiler_legacy,
    _enable_profiler_legacy,
    _profiler_enabled,
)


def mapped_buffer_bytes() -> int:
    """On the CPU, the smallest buffer the C library maps on pages of its own: glibc's
    ``M_MMAP_THRESHOLD``, 128 KiB unless the process was started with
    ``MALLOC_MMAP_THRESHOLD_`` (the allocator's-edge check starts its children at 64 KiB; the
    threshold glibc adjusts by itself only rises). Such a buffer takes up to a page more
    than it asked for, and the resident memory the kernel counts includes it."""
    value = os.environ.get("MALLOC_MMAP_THRESHOLD_", "")
    return int(value) if value.isdigit() else 128 * 2**10


class AllocationLog:
    """Every allocation and free c10's CPU allocator makes while entered, from the autograd
    profiler's memory events (``profile_memory=True``; c10 reports each with its size,
    oneDNN's scratch and im2col's buffers included), read back on exit.

    :meth:`mark` records a point in the step; after exit, ``levels[i]`` is the bytes live at
    mark ``i`` and ``peaks[i]`` the highest between mark ``i - 1`` and mark ``i``, both above
    the level when entered (mark 0); ``live`` and ``peak`` are the step's. A buffer allocated
    before entering and freed inside is not subtracted (the allocator reports no size for
    it), as :class:`StorageMeter` does not. The profiler records the step's ops too, which
    costs each op a few microseconds: the timed steps run without it.
    """

    def __init__(self) -> None:
        self.levels: list[int] = []
        self.peaks: list[int] = []
        self.mapped_levels: list[int] = []
        """Like ``levels`` and ``peaks``, counting the live allocations the C library maps
        on pages of their own (:func:`mapped_buffer_bytes` and over)."""
        self.mapped_peaks: list[int] = []
        self.live = 0
        self.peak = 0
        self._count = 0
        self._allocations: list[tuple[float, int]] = []  # (time, bytes: negative for a free)
        self._marks: list[tuple[int, int]] = []  # (time, index)
        self._profiling = False
        """Whether this log started the profiler and has not stopped it."""
        self._mark_prefix = f"{_MARK}{id(self)}."
        """Its marks' names: a session's events are this log's only (:meth:`_collect`)."""

    @staticmethod
    def available() -> bool:
        """Whether a log can start: torch runs one profiler at a time, and a log running
        inside another of ours pauses it (:func:`_running_logs`)."""
        return not _profiler_enabled() or bool(_running_logs)

    def __enter__(self) -> AllocationLog:
        self._allocations, self._marks, self._count = [], [], 0
        outer = _running_logs[-1] if _running_logs else None
        if outer is not None:
            outer._pause()
        _running_logs.append(self)
        try:
            self._start()
            self.mark()
        except BaseException:  # an interrupt (Ctrl-C) included: the meters are as before
            self._pause()
            _running_logs.remove(self)
            if outer is not None:
                outer._start()
            raise
        return self

    def _start(self) -> None:
        # The autograd profiler without Kineto (``ProfilerState.CPU``): c10 reports the same
        # allocations to it, and a CPU step needs none of Kineto's tracing. Started and
        # stopped once per metered step, Kineto's trace processing corrupted the heap (a
        # crash one fit in about twenty on a 2-core machine, torch 2.14).
        config = ProfilerConfig(ProfilerState.CPU, False, True, False, False, False, _ExperimentalConfig())
        _enable_profiler_legacy(config)
        self._profiling = True

    def _pause(self) -> None:
        """Stop the profiler, keeping what it logged; :meth:`_start` goes on. Stops it at
        most once per start, so an interrupted log can always be left."""
        if self._profiling:
            self._profiling = False
            self._collect(_disable_profiler_legacy())

    def mark(self) -> int:
        """Record a point of the step; its index into ``levels`` and ``peaks``."""
        with torch.autograd.profiler.record_function(f"{self._mark_prefix}{self._count}"):
            pass
        self._count += 1
        return self._count - 1

    def __exit__(self, *exc: object) -> None:
        # Each step runs whatever comes before it raised (an interrupt anywhere in here
        # included): the profiler stopped, the log off the stack, the outer log going on.
        try:
            try:
                self.mark()
            finally:
                self._pause()
        finally:
            if self in _running_logs:
                _running_logs.remove(self)
            if _running_logs:  # the log this one ran inside: its allocations are the outer's too
                outer = _running_logs[-1]
                outer._allocations.extend(self._allocations)
                outer._start()
        self._resolve()

    def window(self, start: int, end: int) -> tuple[int, int, int]:
        """(level at ``start``, peak from ``start`` to ``end``, level at ``end``)."""
        peak = max(self.peaks[start + 1:end + 1], default=self.levels[start])
        return self.levels[start], max(peak, self.levels[start]), self.levels[end]

    def mapped_window(self, start: int, end: int) -> int:
        """The most mapped allocations live at once from mark ``start`` to ``end``, above
        the count at ``start``."""
        peak = max(self.mapped_peaks[start + 1:end + 1], default=0)
        return max(peak - self.mapped_levels[start], 0)

    def _collect(self, threads: list[list[Any]]) -> None:
        for events in threads:  # each thread's events in the order they happened
            for event in events:
                kind = event.kind()
                if kind == "memory_alloc":
                    if event.device() == -1:  # the CPU (a CUDA event names its device)
                        self._allocations.append((event.start_us(), int(event.cpu_memory_usage())))
                elif kind == "push" and event.name().startswith(self._mark_prefix):
                    self._marks.append((event.start_us(), int(event.name()[len(self._mark_prefix):])))

    def _resolve(self) -> None:
        # Each event carries its bytes (negative for a free), so the pieces logged between
        # pauses, and those of logs run inside this one, join into one series by time.
        allocations = sorted(self._allocations, key=lambda a: a[0])  # stable: one thread's order
        marks = sorted(self._marks)
        threshold = mapped_buffer_bytes()
        base = 0
        level = peak = base
        mapped = mapped_peak = 0
        self.levels = [0] * self._count
        self.peaks = [0] * self._count
        self.mapped_levels = [0] * self._count
        self.mapped_peaks = [0] * self._count
        k = 0
        for time, index in marks:
            if index >= self._count:
                continue  # marked and interrupted before it was counted
            peak, mapped_peak = level, mapped
            while k < len(allocations) and allocations[k][0] <= time:
                nbytes = allocations[k][1]
                level += nbytes
                peak = max(peak, level)
                if abs(nbytes) >= threshold:
                    mapped += 1 if nbytes > 0 else -1
                    mapped_peak = max(mapped_peak, mapped)
                k += 1
            self.levels[index] = level - base
            self.peaks[index] = peak - base
            self.mapped_levels[index] = mapped
            self.mapped_peaks[index] = mapped_peak
        self.live = self.levels[-1] if self.levels else 0
        self.peak = max(self.peaks, default=0)


_MARK = "lightning_remat.mark."
"""The name prefix of :meth:`AllocationLog.mark`'s profiler events."""

_running_logs: list[AllocationLog] = []
"""The allocation logs entered and not yet left, innermost last. torch runs one profiler at
a time: a log entered inside another (the planner measuring inside a step that
:class:`~lightning_remat.lightning.MemoryTimeline` meters) pauses it and hands it its
allocations on exit; :func:`paused` pauses the running one without."""


@contextmanager
def paused() -> Iterator[None]:
    """Pause the running allocation log, if any, for the block: the profiler's cost per op
    stays out of what the block times, and the block's allocations out of the log (planning
    inside a metered training step)."""
    if not _running_logs:
        yield
        return
    log = _running_logs[-1]
    try:
        log._pause()
    finally:
        _running_logs.remove(log)
    try:
        yield
    finally:
        _running_logs.append(log)
        log._start()
