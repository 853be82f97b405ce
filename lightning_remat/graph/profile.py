"""Measure every vertex's costs on the module's own device (docs/design.md sections 3 and 6).

``profile_module`` runs real training steps (forward, loss, backward) node by node through a
``torch.fx.Interpreter`` and fills, for each vertex of the traced graph:

- ``mem``: bytes of the output (per storage, at most the storage's size);
- ``saved``: bytes autograd keeps for the op's backward, seen by
  ``torch.autograd.graph.saved_tensors_hooks`` while the op runs, each storage counted once
  (by ``untyped_storage().data_ptr()``), parameters and buffers excluded. ReLU keeps its
  output, Linear its input, BatchNorm its input plus the batch mean and inverse std;
- ``t_fwd``/``t_bwd``: median over ``repeats`` steps after ``warmup`` steps; the forward is
  timed around the op, the backward by pre/post hooks on every autograd node the op created
  (``perf_counter`` on CPU, CUDA events on GPU);
- ``ws_fwd``/``ws_bwd``: the peak during the op above the larger of the bytes in use before
  and after it (the op's temporary workspace; the largest over the measured steps): on CUDA
  the allocator's peak counter, on CPU the tensor storage meter of docs/design.md section 6,
  in one extra step (scratch memory a kernel never makes a tensor is not seen).

Memory-safe mode (``safe=True``, or automatically when the plain step runs out of memory)
never holds all activations: the forward runs under ``no_grad`` (values freed after their
last use, as in inference) and each op is measured on its own from detached copies of its
inputs, forward and backward, then dropped. It gives the same ``mem`` and ``saved``.

Profiling does not change training: buffers (BatchNorm running statistics), training flags,
the RNG state and existing ``.grad`` tensors are restored afterwards; parameters are only read
(no optimizer step runs).

Length: the normal and the memory-safe mode measure with the same interpreter, clocks,
workspace readings and backward hooks, so both stay in one module.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from lightning_remat.device import (
    free_device_memory,
    is_out_of_memory,
    module_device,
    preserved_state,
)
from lightning_remat.errors import warn_caller
from lightning_remat.graph.ir import Graph
from lightning_remat.graph.trace import (
    CHILDREN,
    Traced,
    ValueRecorder,
    as_tuple,
    call_through,
    default_loss,
    is_getitem,
    trace_module,
)
from lightning_remat.meter import StorageMeter, peak_bytes, tensors_in

__all__ = ["profile_module"]

LossFn = Callable[[Any], torch.Tensor]
_INPUT = "<input>"


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(data pointer, bytes) of a tensor's storage; a storage-less tensor counts its own bytes."""
    try:
        st = t.untyped_storage()
        if st.nbytes() == 0:  # empty tensors share address 0: give each its own key
            return -id(t), 0
        return st.data_ptr(), st.nbytes()
    except (RuntimeError, NotImplementedError):  # pragma: no cover - sparse/nested tensors
        return id(t), t.numel() * t.element_size()


def _output_bytes(value: Any) -> int:
    """Bytes of a value's tensors, each storage counted once and at most its own size."""
    per_storage: dict[int, list[int]] = {}
    for t in tensors_in(value):
        ptr, size = _storage(t)
        entry = per_storage.setdefault(ptr, [size, 0])
        entry[1] += t.numel() * t.element_size()
    return sum(min(size, views) for size, views in per_storage.values())


# ---- clocks ---------------------------------------------------------------------------------


class _Clock:
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


class _Workspace:
    """Peak bytes during an op above max(before, after): the op's temporary workspace.

    CUDA: the caching allocator's peak counter. CPU: the :class:`~lightning_remat.meter.StorageMeter`
    the step runs under (docs/design.md section 6): the tensors an op creates and frees
    before it returns; without one (the timed steps, which run without the meter's per-op
    cost) it reads 0.
    """

    def __init__(self, device: torch.device, meter: StorageMeter | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.meter = meter
        self.enabled = self.cuda or meter is not None

    def start(self) -> int:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return torch.cuda.memory_allocated(self.device)
        if self.meter is None:
            return 0
        self.meter.reset_peak()
        return self.meter.live

    def stop(self, before: int) -> int:
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.device)
            after = torch.cuda.memory_allocated(self.device)
        elif self.meter is None:
            return 0
        else:
            peak, after = self.meter.peak, self.meter.live
        return max(0, int(peak - max(before, after)))


# ---- what one measured step records ------------------------------------------------------------


@dataclass
class _Record:
    """Costs seen in one step, keyed by vertex id."""

    mem: dict[str, int] = field(default_factory=dict)
    numel: dict[str, int] = field(default_factory=dict)
    saved_ptrs: dict[str, dict[int, int]] = field(default_factory=lambda: defaultdict(dict))
    saved_refs: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    saved_input: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    aliases: dict[str, str] = field(default_factory=dict)
    resident_views: set[str] = field(default_factory=set)
    requires_grad: dict[str, bool] = field(default_factory=dict)
    t_fwd: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    t_bwd: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    ws_fwd: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    ws_bwd: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    pending: list[tuple[str, str, Any, Any]] = field(default_factory=list)
    """(vertex, 'fwd'|'bwd', start mark, end mark) to resolve after a synchronise."""

    def root(self, vid: str) -> str:
        """The vertex that owns the storage of ``vid``'s output."""
        return self.aliases.get(vid, vid)

    def resolve(self, clock: _Clock) -> None:
        clock.sync()
        for vid, phase, start, end in self.pending:
            if start is None or end is None:
                continue
            target = self.t_fwd if phase == "fwd" else self.t_bwd
            target[vid] += clock.seconds(start, end)
        self.pending.clear()


class _BackwardTimer:
    """Hooks on the autograd nodes an op created, charging their time and workspace to it."""

    def __init__(self, clock: _Clock, workspace: _Workspace) -> None:
        self.clock = clock
        self.workspace = workspace
        self.claimed: set[Any] = set()
        self.skip_leaves: set[int] = set()

    def attach(self, vid: str, outputs: Iterable[torch.Tensor], record: _Record) -> None:
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn in self.claimed:
                continue
            self.claimed.add(fn)
            variable = getattr(fn, "variable", None)
            if variable is not None and id(variable) in self.skip_leaves:
                continue  # gradient of a detached copy made by the safe mode
            self._hook(vid, fn, record)
            stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)

    def _hook(self, vid: str, fn: Any, record: _Record) -> None:
        state: dict[str, Any] = {}

        def pre(grad_outputs: Any) -> None:
            state["ws"] = self.workspace.start()
            state["start"] = self.clock.begin()

        def post(grad_inputs: Any, grad_outputs: Any) -> None:
            end = self.clock.mark()
            record.ws_bwd[vid] = max(record.ws_bwd[vid], self.workspace.stop(state.get("ws", 0)))
            record.pending.append((vid, "bwd", state.get("start"), end))

        try:
            fn.register_prehook(pre)
            fn.register_hook(post)
        except (RuntimeError, AttributeError):  # pragma: no cover - nodes without hooks
            pass

    def clear(self) -> None:
        self.claimed.clear()
        self.skip_leaves.clear()


# ---- node-by-node interpreter ---------------------------------------------------------------------


class _OpMeter:
    """Measures one op's forward (time, workspace, output bytes, what autograd saves, which
    vertex each output storage belongs to) and hooks its backward; shared by the fx
    interpreter and the fallback's submodule profiler."""

    def __init__(self, device: torch.device, excluded_ptrs: set[int], safe: bool, rounds: int,
                 meter: StorageMeter | None = None) -> None:
        self.clock = _Clock(device)
        self.workspace = _Workspace(device, meter)
        self.timer = _BackwardTimer(self.clock, self.workspace)
        self.excluded = excluded_ptrs
        self.safe = safe
        self.records = [_Record() for _ in range(rounds)]

    @property
    def record(self) -> _Record:
        return self.records[0]

    def measure_op(self, rec: _Record, vid: str, run: Callable[[], Any], labels: dict[int, str],
                   elements: Callable[[Any], Iterator[tuple[str, Any]]] | None) -> Any:
        """Run ``run()`` as vertex ``vid``'s op. ``labels``: input storage -> the vertex (or
        the input) it came from. ``elements``: for a tuple producer, (vertex, element) of
        its output; None when the op's output is the vertex's own."""
        packed: list[tuple[int, int]] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            packed.append(_storage(t))
            return t

        ws_before = self.workspace.start()
        start = self.clock.begin()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run()
        end = self.clock.mark()
        rec.ws_fwd[vid] = max(rec.ws_fwd[vid], self.workspace.stop(ws_before))
        rec.pending.append((vid, "fwd", start, end))

        # Which vertex each output storage belongs to: this node's own, or for a tuple
        # producer the getitem vertex that picks the element.
        own: dict[int, list[str]] = defaultdict(list)
        if elements is None:
            for t in tensors_in(out):
                own[_storage(t)[0]].append(vid)
            rec.mem[vid] = _output_bytes(out)
            rec.requires_grad[vid] = any(t.requires_grad for t in tensors_in(out))
            rec.numel[vid] = sum(t.numel() for t in tensors_in(out))
        else:
            for owner, element in elements(out):
                for t in tensors_in(element):
                    own[_storage(t)[0]].append(owner)
        # Views and in-place results share an earlier vertex's storage: record the vertex
        # that owns it (the alias root), or that it is the storage of an input/parameter.
        for ptr, owners in own.items():
            source = labels.get(ptr)
            for k, owner in enumerate(dict.fromkeys(owners)):
                if ptr in self.excluded or source == _INPUT:
                    rec.resident_views.add(owner)
                elif source is not None and source != owner:
                    rec.aliases[owner] = rec.root(source)
                elif k > 0:
                    rec.aliases[owner] = rec.root(owners[0])

        saved_here = rec.saved_ptrs[vid]
        for ptr, size in packed:
            if ptr in self.excluded or ptr in saved_here:
                continue
            saved_here[ptr] = size
            ref = own[ptr][0] if own.get(ptr) else labels.get(ptr)
            if ref == _INPUT:
                rec.saved_input[vid] += size
            elif ref is not None and rec.root(ref) not in rec.saved_refs[vid]:
                rec.saved_refs[vid].append(rec.root(ref))
        self.timer.attach(vid, tensors_in(out), rec)
        return out


class _Profiler(fx.Interpreter, _OpMeter):
    """Runs the traced forward node by node, measuring each compute node (docs/design.md section 3).

    ``safe=False``: one real step; ``run`` returns the output for the loss.
    ``safe=True``: the forward runs under ``no_grad``; each compute node is first measured
    ``rounds`` times on detached inputs with grad enabled, its own backward included.
    """

    def __init__(self, traced: Traced, device: torch.device, excluded_ptrs: set[int],
                 safe: bool = False, rounds: int = 1, meter: StorageMeter | None = None) -> None:
        fx.Interpreter.__init__(self, traced.runner)
        _OpMeter.__init__(self, device, excluded_ptrs, safe, rounds, meter)
        self.traced = traced
        self.charge = traced.charge
        ids = set(traced.graph.ids)
        self.vertex_of = {name: vid for name, vid in traced.charge.items() if vid in ids and name == vid}
        self.requires_grad: dict[str, Any] = {}
        """Safe mode: per node, the pytree of requires_grad flags of its grad-enabled output."""

    def run_node(self, n: fx.Node) -> Any:
        if n.name not in self.charge:
            return super().run_node(n)
        if not self.safe:
            return self._measure(n, self.records[0], prepare=None)
        for rec in self.records:
            self._measure_alone(n, rec)
        with torch.no_grad():
            return super().run_node(n)

    # -- one op ----------------------------------------------------------------------------
    def _label(self, a: fx.Node) -> str | None:
        if a.name in self.vertex_of:
            return self.vertex_of[a.name]
        if a.op == "placeholder":
            return _INPUT
        return None

    def _measure(self, n: fx.Node, rec: _Record, prepare: Callable[[fx.Node, Any], Any] | None) -> Any:
        vid = self.charge[n.name]
        labels: dict[int, str] = {}

        def fetch(a: fx.Node) -> Any:
            value = self.env[a]
            if prepare is not None:
                value = prepare(a, value)
            label = self._label(a)
            if label is not None:
                for t in tensors_in(value):
                    labels.setdefault(_storage(t)[0], label)
            return value

        args = fx.node.map_arg(n.args, fetch)
        kwargs = fx.node.map_arg(n.kwargs, fetch)
        elements = None if n.name in self.vertex_of else (lambda out: self._elements(n, out))
        return self.measure_op(rec, vid, lambda: getattr(self, n.op)(n.target, args, kwargs),
                               labels, elements)

    def _elements(self, n: fx.Node, value: Any) -> Iterator[tuple[str, Any]]:
        """(vertex id, element) for the getitem vertices under a tuple producer, nested
        tuples (an LSTM's ``(out, (h, c))``) included."""
        for user in n.users:
            if not is_getitem(user):
                continue
            element = value[user.args[1]]
            if user.name in self.vertex_of:
                yield self.vertex_of[user.name], element
            elif isinstance(element, (tuple, list)):
                yield from self._elements(user, element)

    def _measure_alone(self, n: fx.Node, rec: _Record) -> None:
        """Safe mode: forward and backward of one node from detached copies of its inputs."""
        inplace = _looks_inplace(n, self.module)
        try:
            self._measure_copy(n, rec, inplace)
        except RuntimeError as exc:
            # An in-place op the name did not reveal: autograd refuses it on a leaf.
            if inplace or "in-place" not in str(exc):
                raise
            self.timer.clear()
            self._measure_copy(n, rec, inplace=True)

    def _measure_copy(self, n: fx.Node, rec: _Record, inplace: bool) -> None:
        copies: set[int] = set()

        def prepare(a: fx.Node, value: Any) -> Any:
            if a.op in ("placeholder", "get_attr") or a.name not in self.requires_grad:
                return value
            flags = self.requires_grad[a.name]

            def detach(t: Any, flag: Any) -> Any:
                if not isinstance(t, torch.Tensor):
                    return t
                leaf = t.detach()
                if inplace:
                    leaf = leaf.clone()
                if flag:
                    leaf.requires_grad_(True)
                    copies.add(id(leaf))
                    if inplace:  # in-place ops refuse leaves that require grad
                        leaf = leaf.clone()
                        self.timer.claimed.add(leaf.grad_fn)
                return leaf

            return pytree.tree_map(detach, value, flags) if flags is not None else value

        self.timer.skip_leaves = copies
        with torch.enable_grad():
            out = self._measure(n, rec, prepare)
        outputs = [t for t in tensors_in(out) if t.requires_grad]
        self.requires_grad[n.name] = pytree.tree_map(
            lambda t: t.requires_grad if isinstance(t, torch.Tensor) else None, out
        )
        if outputs:
            torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
        rec.resolve(self.clock)
        self.timer.clear()
        del out, outputs


class _SubmoduleProfiler(_OpMeter):
    """The fallback's profiler (``Traced.kind == "children"``): the model's own forward runs,
    and each vertex submodule is measured where the forward calls it (its ``forward``
    replaced for the run), as the executor of :mod:`lightning_remat.runtime.hooked` wraps
    it. Safe mode: the forward runs under ``no_grad`` and each submodule is measured
    ``rounds`` times on detached inputs with grad enabled, its own backward included."""

    def __init__(self, traced: Traced, module: nn.Module, device: torch.device,
                 excluded_ptrs: set[int], safe: bool = False, rounds: int = 1,
                 meter: StorageMeter | None = None) -> None:
        super().__init__(device, excluded_ptrs, safe, rounds, meter)
        self.traced, self.module = traced, module
        self.labels: dict[int, str] = {}
        """Storage -> the vertex that produced it (or the input)."""

    def run(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        for t in tensors_in((list(inputs), kwargs)):
            self.labels[_storage(t)[0]] = _INPUT
        with self._measuring():
            return self.module(*inputs, **kwargs)

    @contextmanager
    def _measuring(self) -> Iterator[None]:
        missing = object()
        previous = [(child, child.__dict__.get("forward", missing)) for _, child in self.traced.children]
        for (name, child), (_, before) in zip(self.traced.children, previous):
            inner = before if before is not missing else partial(type(child).forward, child)
            child.forward = self._measured(name, inner)  # type: ignore[method-assign]
        try:
            yield
        finally:
            for child, before in previous:
                child.__dict__.pop("forward", None)
                if before is not missing:
                    child.forward = before  # type: ignore[method-assign]

    def _measured(self, vid: str, inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            labels: dict[int, str] = {}
            for t in tensors_in((list(args), kwargs)):
                ptr = _storage(t)[0]
                if ptr in self.labels:
                    labels.setdefault(ptr, self.labels[ptr])
            if self.safe:
                for rec in self.records:
                    self._measure_alone(vid, inner, args, kwargs, labels, rec)
                with torch.no_grad():
                    out = inner(*args, **kwargs)
            else:
                out = self.measure_op(self.records[0], vid, lambda: inner(*args, **kwargs), labels, None)
            for t in tensors_in(out):
                ptr = _storage(t)[0]
                if ptr not in labels:  # not a view of an input
                    self.labels[ptr] = vid
            return out

        return forward

    def _measure_alone(self, vid: str, inner: Callable[..., Any], args: tuple, kwargs: dict,
                       labels: dict[int, str], rec: _Record) -> None:
        try:
            self._measure_copy(vid, inner, args, kwargs, labels, rec, clone=False)
        except RuntimeError as exc:
            if "in-place" not in str(exc) and "leaf" not in str(exc):
                raise
            self.timer.clear()
            self._measure_copy(vid, inner, args, kwargs, labels, rec, clone=True)

    def _measure_copy(self, vid: str, inner: Callable[..., Any], args: tuple, kwargs: dict,
                      labels: dict[int, str], rec: _Record, clone: bool) -> None:
        copies: set[int] = set()

        def detach(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            leaf = t.detach()
            source = labels.get(_storage(t)[0])
            # Under the no-grad forward nothing requires grad: what a submodule's or the
            # forward's own op produced would, an input only if it did.
            wants = t.requires_grad or (source != _INPUT and (t.is_floating_point() or t.is_complex()))
            if wants:
                if clone:
                    leaf = leaf.clone()
                leaf.requires_grad_(True)
                copies.add(id(leaf))
                if clone:
                    leaf = leaf.clone()
                    self.timer.claimed.add(leaf.grad_fn)
            return leaf

        copied_args, copied_kwargs = pytree.tree_map(detach, (list(args), kwargs))
        self.timer.skip_leaves = copies
        with torch.enable_grad():
            out = self.measure_op(rec, vid, lambda: inner(*copied_args, **copied_kwargs), labels, None)
        outputs = [t for t in tensors_in(out) if t.requires_grad]
        if outputs:
            torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
        rec.resolve(self.clock)
        self.timer.clear()
        del out, outputs


def _looks_inplace(n: fx.Node, root: nn.Module) -> bool:
    if n.op == "call_module":
        return bool(getattr(root.get_submodule(str(n.target)), "inplace", False))
    if n.kwargs.get("inplace"):
        return True
    name = str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", "")
    return (name.endswith("_") and not name.startswith("__")) or name.startswith("__i")


# ---- the public entry point ------------------------------------------------------------------------


def _dtype_of(module: nn.Module, inputs: Iterable[Any]) -> str:
    candidates = list(module.parameters()) + tensors_in(list(inputs))
    for t in candidates:
        if t.is_floating_point():
            return str(t.dtype).replace("torch.", "")
    return "float32"


@contextmanager
def _grads_set_aside(tensors: list[torch.Tensor]) -> Iterator[None]:
    """Move existing .grad tensors away (steps start from none) and put them back after."""
    kept = [(t, t.grad) for t in tensors]
    for t in tensors:
        t.grad = None
    try:
        yield
    finally:
        for t, grad in kept:
            t.grad = grad


def _clear_grads(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        t.grad = None


def _other_batch(inputs: tuple[Any, ...], kwargs: dict[str, Any], batch: int) -> tuple[tuple[Any, ...], dict[str, Any], int]:
    """The inputs at another batch size (half, or 2 when the batch is 1)."""
    other = batch // 2 if batch >= 2 else 2

    def resize(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == batch:
            return t[:other] if other < batch else torch.cat([t] * other)[:other]
        return t

    return pytree.tree_map(resize, inputs), pytree.tree_map(resize, kwargs), other


def _batch_dependence(traced: Traced, module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any],
                      batch: int | None, numel: dict[str, int], device: torch.device) -> dict[str, bool]:
    """Whether each vertex's output size changes with the batch size: one no-grad forward at
    another batch size. Structural fallback (does the vertex depend on an input?) when that
    forward fails or there is no batch dimension."""
    graph = traced.graph
    reach = set(graph.meta.input_consumers or [])
    for vid in graph.ids:
        if any(p in reach for p in graph.predecessors(vid)):
            reach.add(vid)
    structural = {vid: vid in reach for vid in graph.ids}
    if not batch:
        return structural
    small_inputs, small_kwargs, _ = _other_batch(inputs, kwargs, batch)
    try:
        with preserved_state(module, [device]), torch.no_grad():
            small_numel = _numel_per_node(traced, module, small_inputs, small_kwargs)
    except Exception:  # a model that fixes its batch size: keep the structural answer
        return structural
    vertex_of = {name: vid for name, vid in traced.charge.items() if vid in graph and name == vid}
    result = dict(structural)
    for name, vid in vertex_of.items():
        if name in small_numel and vid in numel:
            result[vid] = structural[vid] and small_numel[name] != numel[vid]
    return result


def _numel_per_node(traced: Traced, module: nn.Module, inputs: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> dict[str, int]:
    """Elements of each fx node's value, or of each vertex submodule's output (fallback:
    forward hooks while the model's own forward runs)."""
    if traced.kind != CHILDREN:
        recorder = ValueRecorder(traced.runner)
        call_through(module, lambda: recorder.run(*traced.call_args(inputs, kwargs)))
        return recorder.numel
    found: dict[str, int] = {}
    handles = [
        child.register_forward_hook(
            lambda mod, args, out, name=name: found.setdefault(name, sum(t.numel() for t in tensors_in(out))))
        for name, child in traced.children
    ]
    try:
        module(*inputs, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return found


def profile_module(
    module: nn.Module,
    example_inputs: Any,
    *,
    loss_fn: LossFn | None = None,
    warmup: int | None = None,
    repeats: int = 3,
    safe: bool = False,
    traced: Traced | None = None,
    example_kwargs: dict[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Graph:
    """Trace (unless ``traced`` is given) and profile ``module`` on its device.

    ``example_inputs``: a tensor or a tuple of positional inputs, on the module's device.
    ``loss_fn(outputs) -> scalar``: defaults to the sum of every floating output.
    Returns the :class:`Graph` with measured costs. Its meta
    (:class:`~lightning_remat.graph.ir.GraphMeta`, whose fields :mod:`lightning_remat.graph.ir`
    documents) keeps the tracer's fields and sets ``batch_size``, ``device``, ``dtype``,
    ``input_bytes``, ``plain_peak_bytes`` and ``loss_peak_bytes`` (measured with
    :func:`~lightning_remat.meter.peak_bytes`; None in safe mode), ``step_seconds``,
    ``batch_dependent``, ``saved_refs``, ``saved_input_bytes``, ``aliases``,
    ``requires_grad``, ``resident_views`` and ``safe``.

    Normal mode runs ``warmup`` plain steps (default: 1 on CUDA; 0 on the CPU, where the
    metered step is the first and its storage counts do not depend on warm caches), one
    plain step inside the meter (the plain peak), on the CPU one instrumented step inside
    the meter (bytes and workspaces), then timed instrumented steps: the first, and more
    (up to ``repeats``) only while op times vary enough to change a plan
    (docs/design.md section 3). An op's time is its fastest timed measurement. Safe mode
    measures each op ``warmup`` (default 1) + ``repeats`` times and takes the median.
    ``progress(line)``: called with a short line as each phase starts.
    """
    if warmup is None:
        warmup = 1 if safe or module_device(module).type == "cuda" else 0
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    inputs = as_tuple(example_inputs)
    kwargs = dict(example_kwargs or {})
    # The default sum sends its outputs a broadcast scalar: its memory needs no measurement.
    measure_loss = loss_fn is not None
    loss_fn = loss_fn or default_loss
    device = module_device(module, list(inputs) + list(kwargs.values()))
    if traced is None:
        traced = trace_module(module, inputs, kwargs)
    input_tensors = tensors_in(list(inputs) + list(kwargs.values()))
    batch = next((t.shape[0] for t in input_tensors if t.dim() >= 1), None)
    grad_holders = list(module.parameters()) + [t for t in input_tensors if t.requires_grad]
    excluded = {_storage(t)[0] for t in list(module.parameters()) + list(module.buffers())}
    if traced.kind == CHILDREN:

        def make(safe_mode: bool = False, rounds: int = 1,
                 meter: StorageMeter | None = None) -> tuple[_OpMeter, Callable[[], Any]]:
            profiler = _SubmoduleProfiler(traced, module, device, excluded, safe_mode, rounds, meter)
            return profiler, lambda: profiler.run(inputs, kwargs)
    else:
        args = traced.call_args(inputs, kwargs)

        def make(safe_mode: bool = False, rounds: int = 1,
                 meter: StorageMeter | None = None) -> tuple[_OpMeter, Callable[[], Any]]:
            profiler = _Profiler(traced, device, excluded, safe_mode, rounds, meter)
            # Through the module's call when it is an FSDP unit: its hooks gather and reduce.
            return profiler, lambda: call_through(module, lambda: profiler.run(*args))

    meta = traced.graph.meta.copy()
    meta.batch_size = batch
    meta.device = str(device)
    meta.dtype = _dtype_of(module, inputs)
    meta.input_bytes = _output_bytes(input_tensors)
    # CUDA events and peak counters work on the current device: make it the module's.
    on_device = torch.cuda.device(device) if device.type == "cuda" else nullcontext()
    with on_device, preserved_state(module, [device]), _grads_set_aside(grad_holders):
        fallback_reason = ""
        records: list[_Record] = []
        note = progress or (lambda line: None)
        if not safe:
            try:
                note("profile: the plain step's peak")
                meta.plain_peak_bytes, plain_seconds = _plain_peak(
                    module, inputs, kwargs, loss_fn, device, grad_holders, warmup)
                if measure_loss:
                    meta.loss_peak_bytes, meta.output_grad_bytes = _loss_peak(
                        module, inputs, kwargs, loss_fn, device)
                first, records, wall = _profile_steps(make, loss_fn, grad_holders, repeats, device,
                                                      plain_seconds, note)
                meta.step_seconds = plain_seconds or wall
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                fallback_reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if fallback_reason:
            # The exception (and its frames holding activations) is gone here; free the cache.
            _clear_grads(grad_holders)
            free_device_memory(device)
            warn_caller(f"the training step ran out of memory while profiling "
                        f"({fallback_reason}); profiling again in memory-safe mode")
            safe = True
        if safe:
            meta.plain_peak_bytes = None
            meta.loss_peak_bytes = None
            meta.output_grad_bytes = None
            meta.step_seconds = None
            note("profile: each op alone (memory-safe mode)")
            records = _profile_safe(make, grad_holders, warmup, repeats, device)
            first = records[0]
        _clear_grads(grad_holders)
        note("profile: which sizes grow with the batch")
        meta.batch_dependent = _batch_dependence(traced, module, inputs, kwargs, batch,
                                                 first.numel, device)

    # Timed steps in normal mode: the fastest (a disturbance only adds time); safe mode's
    # rounds: the median.
    combine = statistics.median if safe else min
    nodes = []
    for node in traced.graph.nodes:
        vid = node.id
        nodes.append(replace(
            node,
            mem=first.mem.get(vid, 0),
            saved=sum(first.saved_ptrs.get(vid, {}).values()),
            t_fwd=combine(r.t_fwd.get(vid, 0.0) for r in records),
            t_bwd=combine(r.t_bwd.get(vid, 0.0) for r in records),
            ws_fwd=max(r.ws_fwd.get(vid, 0) for r in [first, *records]),
            ws_bwd=max(r.ws_bwd.get(vid, 0) for r in [first, *records]),
        ))
    meta.saved_refs = {vid: list(first.saved_refs.get(vid, [])) for vid in traced.graph.ids}
    meta.saved_input_bytes = {vid: b for vid, b in first.saved_input.items() if b}
    meta.aliases = dict(first.aliases)
    meta.requires_grad = {vid: first.requires_grad.get(vid, False) for vid in traced.graph.ids}
    meta.resident_views = [vid for vid in traced.graph.ids if vid in first.resident_views]
    meta.safe = safe
    if safe:
        meta.step_seconds = sum(n.t_fwd + n.t_bwd for n in nodes)
    return Graph(nodes, list(traced.graph.edges), meta)


def _backward(loss: torch.Tensor) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"loss_fn must return a scalar tensor, got {loss!r:.80}")
    if not loss.requires_grad:
        raise ValueError(
            "the loss does not require grad: the module has no trainable parameters on the "
            "path to its output and no input requires grad, so there is no backward to profile"
        )
    loss.backward()


def _plain_peak(module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any], loss_fn: LossFn,
                device: torch.device, grad_holders: list[torch.Tensor],
                warmup: int) -> tuple[int, float | None]:
    """Plain forward+backward steps: ``warmup`` unmeasured, then one inside the meter
    (``meta.plain_peak_bytes``). On CUDA the allocator's counters cost the step nothing, so
    its time is the plain step's (``meta.step_seconds``); on the CPU the storage meter's
    per-op cost is in it, so no time is returned."""
    clock = _Clock(device)

    def step() -> None:
        _backward(loss_fn(module(*inputs, **kwargs)))

    for _ in range(warmup):
        step()
        _clear_grads(grad_holders)
    start = time.perf_counter()
    peak = peak_bytes(step, device)  # collects garbage first (CPU)
    clock.sync()
    seconds = time.perf_counter() - start if device.type == "cuda" else None
    _clear_grads(grad_holders)
    return int(peak), seconds


def _loss_peak(module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any], loss_fn: LossFn,
               device: torch.device) -> tuple[int, int]:
    """The loss alone (``meta.loss_peak_bytes``): on the outputs of a forward without
    autograd, made leaves, the peak of ``loss_fn`` and the gradients it sends to the
    outputs, inside the meter. A sum sends a broadcast scalar (nothing); a cross-entropy
    over a vocabulary holds its log-probabilities and their gradient beside the logits'.
    With it, the bytes of those gradients (``meta.output_grad_bytes``): each storage once."""
    with torch.no_grad():
        outputs = module(*inputs, **kwargs)

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
            return value.detach().requires_grad_()
        return value

    leaves = pytree.tree_map(leaf, outputs)
    del outputs
    wanting = [t for t in pytree.tree_leaves(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]

    sent: list[torch.Tensor] = []
    peak = int(peak_bytes(partial(_loss_and_gradients, loss_fn, leaves, wanting, sent), device))
    storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in sent}
    del sent
    held = [weakref.ref(t) for t in wanting]
    del leaves, wanting
    if any(ref() is not None for ref in held):
        warn_caller(
            "the loss keeps the module's outputs alive after it returns (a reference cycle, or a "
            "reference kept elsewhere), so they outlive the start of the backward, where the plan "
            "counts them freed: the measured peak can exceed the plan's. Take the loss without "
            "keeping the outputs (a recursive closure over a list of them is such a cycle)")
    return peak, int(sum(storages.values()))


def _loss_and_gradients(loss_fn: LossFn, leaves: Any, wanting: list[torch.Tensor],
                        sent: list[torch.Tensor]) -> None:
    loss = loss_fn(leaves)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        grads = torch.autograd.grad(loss, wanting, allow_unused=True)
        sent.extend(g for g in grads if g is not None)


_UNSETTLED_SHARE = 0.05
"""Timed steps repeat while the time in doubt is above this share of the step."""
_VARIES = 0.25
"""An op whose two timings differ by more than this fraction varies across steps."""


def _op_times(record: _Record) -> dict[str, float]:
    return {vid: record.t_fwd.get(vid, 0.0) + record.t_bwd.get(vid, 0.0)
            for vid in set(record.t_fwd) | set(record.t_bwd)}


def _time_in_doubt(timed: list[_Record], upper: _Record | None, step_seconds: float | None) -> float:
    """Seconds of the step whose measurement another timed step could change, as a share
    of the step. With two timed steps or more: the time of the ops whose latest timing
    differs from their fastest by more than :data:`_VARIES`. With one: on the CPU, the time
    by which an op ran slower than in the metered step (which carries the meter's per-op
    cost on top, so an undisturbed op is never slower without it); on CUDA, the time by
    which the ops' sum exceeds the plain step they are part of."""
    latest = _op_times(timed[-1])
    total = sum(latest.values()) or 1e-12
    if len(timed) >= 2:
        fastest = {vid: min(_op_times(r).get(vid, 0.0) for r in timed[:-1]) for vid in latest}
        doubt = sum(t for vid, t in latest.items()
                    if abs(t - fastest[vid]) > _VARIES * max(fastest[vid], 1e-9))
        return doubt / total
    if upper is not None:
        bound = _op_times(upper)
        return sum(max(0.0, t - bound.get(vid, t)) for vid, t in latest.items()) / total
    if step_seconds:
        return max(0.0, total - step_seconds) / total
    return 0.0


def _profile_steps(make: Callable[..., tuple[_OpMeter, Callable[[], Any]]], loss_fn: LossFn,
                   grad_holders: list[torch.Tensor], repeats: int, device: torch.device,
                   plain_seconds: float | None,
                   note: Callable[[str], None]) -> tuple[_Record, list[_Record], float]:
    """Normal mode: instrumented steps, each op measured as the forward reaches it
    (docs/design.md section 3). Returns the record whose bytes count (CPU: a step under
    the storage meter, whose workspaces it reads; CUDA: the first timed step, whose
    workspaces come from the allocator's counters), the timed records, and the fastest
    timed step's wall time. A timed step repeats, up to ``repeats``, only while the time in
    doubt (:func:`_time_in_doubt`) is above :data:`_UNSETTLED_SHARE` of the step: one
    timed step where one will do."""

    def step(meter: StorageMeter | None = None) -> tuple[_Record, float]:
        profiler, run = make(meter=meter)
        start = time.perf_counter()
        loss = loss_fn(run())
        _backward(loss)
        profiler.record.resolve(profiler.clock)
        seconds = time.perf_counter() - start
        profiler.timer.clear()
        del loss
        _clear_grads(grad_holders)
        return profiler.record, seconds

    metered: _Record | None = None
    if device.type != "cuda":
        note("profile: the step's bytes, op by op")
        with StorageMeter(device.type) as meter:
            metered, _ = step(meter)
    timed: list[_Record] = []
    walls: list[float] = []
    while len(timed) < repeats:
        note("profile: the step's times, op by op" if not timed else
             f"profile: op times varied, timing again ({len(timed) + 1} of at most {repeats})")
        record, wall = step()
        timed.append(record)
        walls.append(wall)
        if _time_in_doubt(timed, metered, plain_seconds) <= _UNSETTLED_SHARE:
            break
    return metered if metered is not None else timed[0], timed, min(walls)


def _profile_safe(make: Callable[..., tuple[_OpMeter, Callable[[], Any]]],
                  grad_holders: list[torch.Tensor], warmup: int, repeats: int,
                  device: torch.device) -> list[_Record]:
    """Memory-safe mode: one no-grad forward; each op measured alone ``warmup + repeats``
    times (forward and backward), its activations dropped before the next op."""
    meter = StorageMeter(device.type) if device.type != "cuda" else None
    profiler, run = make(True, warmup + repeats, meter)
    with meter if meter is not None else nullcontext(), torch.no_grad():
        run()
    _clear_grads(grad_holders)
    return profiler.records[warmup:]
