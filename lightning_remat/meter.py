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

``record_timeline`` gives the same readings op by op through one step (forward and
backward), the measured counterpart of ``solvers.simulate``'s predicted timeline.

Length: the three CPU meters (the allocation log, the storage meter, the timeline) share
the storage accounting and the fallback between them, so they stay in one module.
"""

from __future__ import annotations

import gc
import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


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


class StorageMeter(TorchDispatchMode):
    """Live and peak bytes of the tensor storage created on ``device_type`` while entered.

    An op's output counts as new memory when its schema says it does not alias an input
    (views, in-place and ``out=`` results do) and its storage is none of the inputs'; a
    storage counted once is not counted again (a view of it, an in-place op on it), and a
    resize is followed. ``live`` and ``peak`` start at zero: the reading is above whatever
    was allocated before. Storage created before and freed during the measurement is not
    subtracted (it was never added).
    """

    def __init__(self, device_type: str = "cpu") -> None:
        super().__init__()
        self.device_type = device_type
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now."""
        self.peak = self.live

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        values = [out] if len(returns) == 1 else list(out) if isinstance(out, (tuple, list)) else [out]
        inputs: set[int] | None = None
        for value, ret in zip(values, returns):
            fresh = ret.alias_info is None
            for t in tree_leaves(value):
                if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
                    continue
                # A DTensor (torch FSDP2's parameters, their gradients and optimizer state)
                # has no storage of its own: its local shard's is what it takes.
                t = _local(t)
                try:
                    storage = t.untyped_storage()
                    storage.data_ptr()
                except (RuntimeError, NotImplementedError):  # sparse, nested: no storage
                    continue
                key = id(storage)
                if key in self._sizes:
                    self._resized(key, storage.nbytes())
                    continue
                if not fresh:
                    continue
                if inputs is None:  # an op that returns an input without saying so
                    inputs = {_data_ptr(a) for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
                if storage.data_ptr() in inputs:
                    continue
                self._add(key, storage)
        self.peak = max(self.peak, self.live)
        return out

    def _add(self, key: int, storage: torch.UntypedStorage) -> None:
        nbytes = storage.nbytes()
        self._sizes[key] = nbytes
        self.live += nbytes
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._freed(key))

    def _resized(self, key: int, nbytes: int) -> None:
        if nbytes != self._sizes[key]:
            self.live += nbytes - self._sizes[key]
            self._sizes[key] = nbytes

    def _freed(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)


def _local(t: torch.Tensor) -> torch.Tensor:
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


StepMeter = AllocationLog | StorageMeter
"""A CPU step's meter (:func:`step_meter`)."""


def _data_ptr(t: torch.Tensor) -> int:
    try:
        return _local(t).untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return -1


def is_cuda(device: Any) -> bool:
    return torch.device(device).type == "cuda"


@contextmanager
def collector_settled() -> Iterator[None]:
    """One garbage collection, then the objects alive now out of the collector's reach
    (``gc.freeze``) until the block ends, for a block that measures many steps (the
    batch-size search): the CPU meter collects garbage before every measured step
    (:func:`peak_bytes`), which with a Trainer's objects in reach takes a large part of a
    second. Where objects are frozen already (the caller's own, or an enclosing block's),
    nothing changes: unfreezing would thaw them too."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


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
    gc.collect()  # garbage from before would be freed during fn: never counted, never subtracted
    with step_meter(torch.device(device).type) as meter:
        fn()
    return int(meter.peak)


def live_bytes(device: str | torch.device = "cpu", meter: StorageMeter | None = None) -> int:
    """Bytes in use now: CUDA allocated bytes, or on CPU the tensor storage ``meter`` has
    seen created and still alive (0 without one)."""
    if is_cuda(device):
        return int(torch.cuda.memory_allocated(device))
    return meter.live if meter is not None else 0


# ---- timeline recorder ----------------------------------------------------------------------


@dataclass
class TimelinePoint:
    """Live bytes after one op of a recorded step, above what was resident before it."""

    phase: str
    """``forward`` or ``backward``."""
    op: str
    """The fx node's name (the graph IR's vertex id), the leaf module's qualified name in
    the fallback, or ``loss``."""
    live_bytes: int
    """Bytes live after the op (for a backward op: after autograd released its inputs and
    saved tensors)."""
    peak_bytes: int
    """The highest bytes since the previous point (the op's own peak)."""


class _Reader:
    """Live and peak readings relative to the level before the step, one per timeline point.
    The CUDA path and the CPU path differ only here: CUDA reads the caching allocator's
    counters (after a sync) as the step runs; CPU marks the point in the
    :class:`AllocationLog` entered for the step (``with reader:``) and the readings are
    filled in when it exits (a :class:`StorageMeter`, where another profiler runs, is read
    as the step runs)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.meter = None if self.cuda else step_meter(device.type)
        self._marked: list[tuple[TimelinePoint, int, int]] = []  # (point, previous mark, its mark)
        self._last_mark = 0
        gc.collect()
        self.reset_peak()
        self.base = self._live()

    def __enter__(self) -> _Reader:
        if self.meter is not None:
            self.meter.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.meter is None:
            return
        self.meter.__exit__(*exc)
        if isinstance(self.meter, AllocationLog):
            for point, start, end in self._marked:
                _, peak, live = self.meter.window(start, end)
                point.live_bytes, point.peak_bytes = live, peak

    def _live(self) -> int:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.memory_allocated(self.device))
        return self.meter.live if isinstance(self.meter, StorageMeter) else 0

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif isinstance(self.meter, StorageMeter):
            self.meter.reset_peak()

    def point(self, phase: str, op: str) -> TimelinePoint:
        """The point after ``op``: its live bytes and the peak since the previous point
        (filled in on exit on the CPU)."""
        if isinstance(self.meter, AllocationLog):
            mark = self.meter.mark()
            point = TimelinePoint(phase, op, 0, 0)
            self._marked.append((point, self._last_mark, mark))
            self._last_mark = mark
            return point
        live = self._live()
        if self.cuda:
            peak = int(torch.cuda.max_memory_allocated(self.device))
        else:
            assert isinstance(self.meter, StorageMeter)
            peak = self.meter.peak
        self.reset_peak()
        return TimelinePoint(phase, op, live - self.base, max(peak, live) - self.base)

    def same(self, point: TimelinePoint, op: str) -> TimelinePoint:
        """Another op's point with ``point``'s reading (ops whose last nodes ran together)."""
        twin = TimelinePoint(point.phase, op, point.live_bytes, point.peak_bytes)
        for point_, start, end in self._marked:
            if point_ is point:
                self._marked.append((twin, start, end))
                break
        return twin


_STOP_NODES = ("AccumulateGrad",)


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors inside a value: an op's output or arguments, any nesting of tuples,
    lists and dicts (torch's pytree)."""
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


class _BackwardAttribution:
    """Which autograd nodes each forward op created: found by walking from the op's output
    ``grad_fn`` towards its inputs' ``grad_fn`` (captured before the op ran, so in-place
    ops are handled). Each op gets one backward point, read after its last node ran."""

    def __init__(self) -> None:
        self.owner: dict[Any, str] = {}
        self.remaining: dict[str, int] = {}
        self.order: list[str] = []

    def attribute(self, op: str, outputs: Any, stop: set[Any]) -> None:
        todo = [t.grad_fn for t in tensors_in(outputs) if t.grad_fn is not None]
        count = 0
        while todo:
            fn = todo.pop()
            if fn is None or fn in stop or fn in self.owner or type(fn).__name__ in _STOP_NODES:
                continue
            self.owner[fn] = op
            count += 1
            todo.extend(nxt for nxt, _ in fn.next_functions)
        if count:
            self.remaining[op] = self.remaining.get(op, 0) + count
            self.order.append(op)


def _input_grad_fns(args: Any) -> set[Any]:
    return {t.grad_fn for t in tensors_in(args) if t.grad_fn is not None}


def record_timeline(
    module: torch.nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    device: str | torch.device | None = None,
) -> list[TimelinePoint]:
    """Live bytes after every forward and backward op of one training step
    (``loss_fn(module(*example_inputs)).backward()``), above what is resident before it.

    Forward points: one per ``torch.fx`` node of the module (its name is the graph IR's
    vertex id), read between nodes; when fx cannot trace the module, one per leaf module,
    read from forward hooks. Then a ``loss`` point. Backward points: one per forward op
    whose autograd nodes ran, read from autograd node hooks after its last node (when the
    engine has released that node's inputs and saved tensors), in the order they ran.
    The parameters' gradients are set to None for the step (first-step behaviour: they
    are allocated during the backward) and restored afterwards. ``loss_fn`` defaults to
    the sum of the output's elements.
    """
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    if device is None:
        first = next(iter(module.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
    device = torch.device(device)
    loss_fn = loss_fn or (lambda out: sum(t.sum() for t in tensors_in(out)))

    old_grads = {p: p.grad for p in module.parameters()}
    for p in old_grads:
        p.grad = None
    points: list[TimelinePoint] = []
    attribution = _BackwardAttribution()
    reader = _Reader(device)
    try:
        with reader:
            output = _forward_with_points(module, example_inputs, reader, points, attribution)
            loss = loss_fn(output)
            del output
            attribution.attribute("loss", loss, set())
            points.append(reader.point("forward", "loss"))
            _backward_with_points(loss, reader, points, attribution)
            del loss
    finally:
        for p, g in old_grads.items():
            p.grad = g
    return points


def _forward_with_points(
    module: torch.nn.Module, inputs: tuple, reader: _Reader, points: list[TimelinePoint],
    attribution: _BackwardAttribution,
) -> Any:
    import torch.fx

    try:
        traced = torch.fx.symbolic_trace(module)
    except Exception:  # noqa: BLE001 - any trace failure means: use leaf-module hooks
        traced = None
    if traced is not None:

        class PointInterpreter(torch.fx.Interpreter):
            previous: str | None = None

            def run_node(self, n: torch.fx.Node) -> Any:
                if n.op in ("placeholder", "get_attr", "output"):
                    return super().run_node(n)
                # Reading here sees the previous node's dead inputs already dropped.
                self.flush()
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                stop = _input_grad_fns((args, kwargs))
                del args, kwargs
                result = super().run_node(n)
                attribution.attribute(n.name, result, stop)
                self.previous = n.name
                return result

            def flush(self) -> None:
                if self.previous is not None:
                    points.append(reader.point("forward", self.previous))
                    self.previous = None

        interpreter = PointInterpreter(traced)
        output = interpreter.run(*inputs)
        interpreter.flush()
        return output

    leaves = [(name, m) for name, m in module.named_modules() if not list(m.children())]
    stops: dict[int, set[Any]] = {}
    handles = []

    def pre_hook(name: str, mod: torch.nn.Module, args: Any) -> None:
        stops[id(mod)] = _input_grad_fns(args)

    def post_hook(name: str, mod: torch.nn.Module, args: Any, out: Any) -> None:
        attribution.attribute(name, out, stops.pop(id(mod), set()))
        points.append(reader.point("forward", name))

    for name, leaf in leaves:
        handles.append(leaf.register_forward_pre_hook(
            lambda mod, args, name=name: pre_hook(name, mod, args)))
        handles.append(leaf.register_forward_hook(
            lambda mod, args, out, name=name: post_hook(name, mod, args, out)))
    try:
        return module(*inputs)
    finally:
        for h in handles:
            h.remove()


def _backward_with_points(
    loss: torch.Tensor, reader: _Reader, points: list[TimelinePoint],
    attribution: _BackwardAttribution,
) -> None:
    finished: list[str] = []  # ops whose last node has run, waiting for their reading
    handles = []

    def flush() -> None:
        if finished:
            first = reader.point("backward", finished[0])
            points.append(first)
            points.extend(reader.same(first, op) for op in finished[1:])
            finished.clear()

    def pre(fn: Any) -> None:
        # The previous node's inputs and saved tensors are released by now.
        flush()

    def post(fn: Any) -> None:
        op = attribution.owner[fn]
        attribution.remaining[op] -= 1
        if attribution.remaining[op] == 0:
            finished.append(op)

    for fn in attribution.owner:
        handles.append(fn.register_prehook(lambda grads, fn=fn: pre(fn)))
        handles.append(fn.register_hook(lambda gin, gout, fn=fn: post(fn)))
    try:
        loss.backward()
        flush()
    finally:
        for h in handles:
            h.remove()
