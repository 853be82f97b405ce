"""What the profiler reads while an op runs (docs/design.md sections 3 and 6): the bytes of a
value's storages, the clocks that time an op (``perf_counter`` on the CPU, CUDA events behind
a device backlog on GPU), the workspace an op takes above what it keeps, and the hooks that
charge an op's backward to it; :class:`OpRecord` holds what one measured step saw.
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_remat.measure.allocations import AllocationLog
from lightning_remat.measure.peak import StepMeter
from lightning_remat.measure.timeline import tensors_in

__all__ = ["INPUT", "BackwardTimer", "Clock", "OpRecord", "Workspace", "output_bytes", "storage_of"]

INPUT = "<input>"
"""The label of a storage that belongs to the step's inputs (not to a vertex)."""


def storage_of(t: torch.Tensor) -> tuple[int, int]:
    """(data pointer, bytes) of a tensor's storage; a storage-less tensor counts its own bytes."""
    try:
        st = t.untyped_storage()
        if st.nbytes() == 0:  # empty tensors share address 0: give each its own key
            return -id(t), 0
        return st.data_ptr(), st.nbytes()
    except (RuntimeError, NotImplementedError):  # pragma: no cover - sparse/nested tensors
        return id(t), t.numel() * t.element_size()


def output_bytes(value: Any) -> int:
    """Bytes of a value's tensors, each storage counted once and at most its own size."""
    per_storage: dict[int, list[int]] = {}
    for t in tensors_in(value):
        ptr, size = storage_of(t)
        entry = per_storage.setdefault(ptr, [size, 0])
        entry[1] += t.numel() * t.element_size()
    return sum(min(size, views) for size, views in per_storage.values())


# ---- clocks ---------------------------------------------------------------------------------


class Clock:
    """Timestamps resolved after a synchronise: perf_counter on CPU, CUDA events on GPU.

    An event recorded on an idle GPU completes at once, so the op's time would include the
    Python dispatch before its kernel is queued, which dominates small ops. :meth:`begin`
    first queues a spin of the device (``torch.cuda._sleep``) longer than that dispatch, as
    measured once per device (:func:`_dispatch_backlog_cycles`): the start event then runs
    after the spin, when the op's kernels are already queued behind it, and the pair times
    the kernels alone."""

    def __init__(self, device: torch.device, backlog_cycles: int | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self._backlog_cycles = backlog_cycles

    def begin(self) -> Any:
        """The start of a timed op (on CUDA behind a backlog that outlasts the dispatch)."""
        if self.cuda:
            if self._backlog_cycles is None:
                self._backlog_cycles = _dispatch_backlog_cycles(self.device)
            torch.cuda._sleep(self._backlog_cycles)  # CUDA only: the device busy while Python dispatches
        return self.mark()

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)  # CUDA only
            event.record()  # CUDA only
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        if self.cuda:
            return start.elapsed_time(end) / 1e3  # CUDA only
        return end - start

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)  # CUDA only


_BACKLOG_CYCLES: dict[str, int] = {}


def _dispatch_backlog_cycles(device: torch.device, safety: float = 4.0) -> int:
    """CUDA only: device cycles that outlast ``safety`` times the host's dispatch of a small
    op: the dispatch measured with perf_counter, the device's cycles per second with events
    around a known spin."""
    key = str(device)
    if key not in _BACKLOG_CYCLES:
        with torch.cuda.device(device):
            probe = torch.zeros(1, device=device)
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            for _ in range(50):
                probe.add_(1)
            dispatch_s = (time.perf_counter() - started) / 50
            spin = 1_000_000
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(spin)
            end.record()
            end.synchronize()
            cycles_per_s = spin / max(start.elapsed_time(end) / 1e3, 1e-9)
        _BACKLOG_CYCLES[key] = max(1000, int(safety * dispatch_s * cycles_per_s))
    return _BACKLOG_CYCLES[key]


class Workspace:
    """Peak bytes during an op above max(before, after): the op's temporary workspace.

    CUDA: the caching allocator's peak counter, read as the op ends. CPU: the meter the step
    runs under (docs/design.md section 6): an :class:`~lightning_remat.measure.allocations.AllocationLog`,
    which sees every allocation, op-internal buffers included, and gives the readings once
    it has exited (:meth:`settle`); a ``StorageMeter`` (another profiler running) sees only
    the tensors an op creates and frees before it returns. Without a meter (the timed steps,
    which run without the meter's per-op cost) it reads 0.
    """

    def __init__(self, device: torch.device, meter: StepMeter | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.meter = meter
        self.enabled = self.cuda or meter is not None
        self._windows: list[tuple[dict[str, int], str, int, int]] = []
        self._spans: list[tuple[dict[str, int], str, int, list[Any], int]] = []
        self.scratch_buffers = 0
        """CPU, under an allocation log: the most buffers the C library maps on their own
        (``meter.mapped_buffer_bytes`` and over) that one op allocated and held at once."""

    def start(self) -> int:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return torch.cuda.memory_allocated(self.device)
        if self.meter is None:
            return 0
        if isinstance(self.meter, AllocationLog):
            return self.meter.mark()
        self.meter.reset_peak()
        return self.meter.live

    def stop(self, before: int, into: dict[str, int], vid: str) -> None:
        """Raise ``into[vid]`` to the workspace since :meth:`start` returned ``before``."""
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.device)
            after = torch.cuda.memory_allocated(self.device)
        elif self.meter is None:
            return
        elif isinstance(self.meter, AllocationLog):
            self._windows.append((into, vid, before, self.meter.mark()))
            return
        else:
            peak, after = self.meter.peak, self.meter.live
        into[vid] = max(into[vid], int(peak - max(before, after)))

    def node_peak(self, before: int) -> Any:
        """The peak since :meth:`start` returned ``before``, for :meth:`stop_span` (under
        the CPU log: the window, resolved in :meth:`settle`; without a meter: None)."""
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.meter is None:
            return None
        if isinstance(self.meter, AllocationLog):
            return (before, self.meter.mark())
        return self.meter.peak

    def stop_span(self, first: int, peaks: list[Any], handed: int, into: dict[str, int], vid: str) -> None:
        """Raise ``into[vid]`` to the backward workspace of an op that ran as several
        autograd nodes: its highest bytes over them (``peaks``, from :meth:`node_peak`)
        above the bytes in use when the first started (``first``, from :meth:`start`) and
        the new gradients it handed on (``handed``, which the simulator allocates itself)."""
        if any(peak is None for peak in peaks):
            return
        if isinstance(self.meter, AllocationLog) and not self.cuda:
            self._spans.append((into, vid, first, peaks, handed))
            return
        into[vid] = max(into[vid], int(max(peaks) - first - handed))

    def settle(self) -> None:
        """The CPU log's workspaces, once it has exited."""
        if not isinstance(self.meter, AllocationLog):
            return
        for into, vid, start, end in self._windows:
            before, peak, after = self.meter.window(start, end)
            into[vid] = max(into[vid], peak - max(before, after))
            self.scratch_buffers = max(self.scratch_buffers, self.meter.mapped_window(start, end))
        self._windows.clear()
        for into, vid, first, windows, handed in self._spans:
            peak = max(self.meter.window(start, end)[1] for start, end in windows)
            into[vid] = max(into[vid], peak - self.meter.levels[first] - handed)
        self._spans.clear()


# ---- what one measured step records ------------------------------------------------------------


@dataclass
class OpRecord:
    """Costs seen in one step, keyed by vertex id."""

    mem: dict[str, int] = field(default_factory=dict)
    numel: dict[str, int] = field(default_factory=dict)
    saved_ptrs: dict[str, dict[int, int]] = field(default_factory=lambda: defaultdict(dict))
    saved_refs: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    saved_input: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    aliases: dict[str, str] = field(default_factory=dict)
    resident_views: set[str] = field(default_factory=set)
    requires_grad: dict[str, bool] = field(default_factory=dict)
    scratch_buffers: int = 0
    """CPU: the most mapped buffers one op held at once (``Workspace.scratch_buffers``)."""
    t_fwd: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    t_bwd: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    ws_fwd: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    ws_bwd: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    pending: list[tuple[str, str, Any, Any]] = field(default_factory=list)
    """(vertex, 'fwd'|'bwd', start mark, end mark) to resolve after a synchronise."""

    def root(self, vid: str) -> str:
        """The vertex that owns the storage of ``vid``'s output."""
        return self.aliases.get(vid, vid)

    def resolve(self, clock: Clock) -> None:
        clock.sync()
        for vid, phase, start, end in self.pending:
            if start is None or end is None:
                continue
            target = self.t_fwd if phase == "fwd" else self.t_bwd
            target[vid] += clock.seconds(start, end)
        self.pending.clear()


class _Span:
    """The autograd nodes of one op whose backward runs as several (a composite op:
    ``cross_entropy`` is ``nll_loss`` of ``log_softmax``, ``linear`` an ``addmm`` of a
    transpose, the math attention a chain of ``bmm``/``softmax``/``dropout``). The gradients
    its nodes pass each other are live during its backward, and neither a gradient it hands
    on nor any one node's workspace, so the op's backward workspace is read over all of them
    (:meth:`Workspace.stop_span`) once each has run."""

    def __init__(self, nodes: list[Any]) -> None:
        self.nodes = set(nodes)
        self.left = len(nodes)
        self.first: int = 0
        self.entered = False
        self.peaks: list[Any] = []
        self.handed = 0
        """Bytes of the new gradient storages handed to nodes of other ops."""
        # By address, each with weak references to the gradients seen there: a storage
        # freed inside the span can have its address taken by a new one, which is new
        # only where none of the gradients seen at that address is alive.
        self._incoming: dict[int, list[weakref.ref]] = {}
        self._made: dict[int, list[weakref.ref]] = {}
        self._counted: set[int] = set()

    @staticmethod
    def _alive(seen: dict[int, list[weakref.ref]], ptr: int) -> bool:
        return any(ref() is not None for ref in seen.get(ptr, ()))

    def enter(self, before: int, grad_outputs: Any) -> None:
        if not self.entered:
            self.entered, self.first = True, before
        for grad in grad_outputs:
            if isinstance(grad, torch.Tensor):
                ptr = storage_of(grad)[0]
                if not self._alive(self._made, ptr):
                    self._incoming.setdefault(ptr, []).append(weakref.ref(grad))

    def leave(self, fn: Any, grad_inputs: Any, peak: Any) -> None:
        self.left -= 1
        self.peaks.append(peak)
        for grad, (nxt, _) in zip(grad_inputs, fn.next_functions):
            if not isinstance(grad, torch.Tensor):
                continue
            ptr, size = storage_of(grad)
            self._made.setdefault(ptr, []).append(weakref.ref(grad))
            if nxt is None or nxt in self.nodes or self._alive(self._incoming, ptr) or ptr in self._counted:
                continue
            self._counted.add(ptr)
            self.handed += size


class BackwardTimer:
    """Hooks on the autograd nodes an op created, charging their time and workspace to it."""

    def __init__(self, clock: Clock, workspace: Workspace) -> None:
        self.clock = clock
        self.workspace = workspace
        self.claimed: set[Any] = set()
        self.skip_leaves: set[int] = set()
        self.handles: list[Any] = []
        """The hooks' handles: a parameter's AccumulateGrad node outlives the step, so its
        hooks must go when the op's backward has run (:meth:`clear`)."""

    def attach(self, vid: str, outputs: Iterable[torch.Tensor], record: OpRecord) -> None:
        nodes: list[Any] = []
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn in self.claimed:
                continue
            self.claimed.add(fn)
            variable = getattr(fn, "variable", None)
            if variable is not None and id(variable) in self.skip_leaves:
                continue  # gradient of a detached copy made by the safe mode
            nodes.append(fn)
            stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
        # A parameter's AccumulateGrad node keeps what it is given: a gradient handed on.
        inner = [fn for fn in nodes if getattr(fn, "variable", None) is None]
        span = _Span(inner) if len(inner) > 1 else None
        for fn in nodes:
            self._hook(vid, fn, record, span if span is not None and fn in span.nodes else None)

    def _hook(self, vid: str, fn: Any, record: OpRecord, span: _Span | None = None) -> None:
        state: dict[str, Any] = {}

        def pre(grad_outputs: Any) -> None:
            state["ws"] = self.workspace.start()
            if span is not None:
                span.enter(state["ws"], grad_outputs)
            state["start"] = self.clock.begin()

        def post(grad_inputs: Any, grad_outputs: Any) -> None:
            end = self.clock.mark()
            if span is not None:
                span.leave(fn, grad_inputs, self.workspace.node_peak(state.get("ws", 0)))
            self.workspace.stop(state.get("ws", 0), record.ws_bwd, vid)
            if span is not None and span.left == 0:
                self.workspace.stop_span(span.first, span.peaks, span.handed, record.ws_bwd, vid)
            record.pending.append((vid, "bwd", state.get("start"), end))

        try:
            self.handles.append(fn.register_prehook(pre))
            self.handles.append(fn.register_hook(post))
        except (RuntimeError, AttributeError):  # pragma: no cover - nodes without hooks
            pass

    def clear(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.claimed.clear()
        self.skip_leaves.clear()
