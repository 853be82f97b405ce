"""Live bytes op by op through one real step, forward and backward: the measured
counterpart of ``solvers.simulate``'s predicted timeline (docs/design.md section 6,
"Timeline").

:class:`StepRecorder` takes the readings. Whatever runs the forward calls
:meth:`StepRecorder.after` after each op: a point, and the autograd nodes the op made
become the op's own. :meth:`StepRecorder.step` runs the forward, the loss and the backward,
with one point after each op's last autograd node has run, and an op run again in the
backward (a recomputation) gets a ``recompute`` point. :func:`record_timeline` drives it
for any module: a point per ``torch.fx`` node, or per leaf module where fx cannot trace it.
:func:`aligned` puts a step's points on the ops of another timeline (a planned step's on
the simulator's, op for op)."""

from __future__ import annotations

import gc
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from lightning_remat.measure.allocations import AllocationLog
from lightning_remat.measure.peak import collector_settled, step_meter
from lightning_remat.measure.storage import StorageMeter

__all__ = ["StepRecorder", "TimelinePoint", "aligned", "record_timeline", "tensors_in"]


@dataclass
class TimelinePoint:
    """Live bytes after one op of a recorded step, above what was resident before it."""

    phase: str
    """``forward``, ``recompute`` (the op run again in the backward) or ``backward``."""
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

    def extend(self, point: TimelinePoint) -> None:
        """``point``, the latest, read again now: what ran since is part of its op."""
        if isinstance(self.meter, AllocationLog):
            mark = self.meter.mark()
            for k, (point_, start, _) in enumerate(self._marked):
                if point_ is point:
                    self._marked[k] = (point, start, mark)
            self._last_mark = mark
            return
        later = self.point(point.phase, point.op)
        point.live_bytes, point.peak_bytes = later.live_bytes, max(point.peak_bytes, later.peak_bytes)

    def same(self, point: TimelinePoint, op: str) -> TimelinePoint:
        """Another op's point with ``point``'s reading (ops whose last nodes ran together)."""
        twin = TimelinePoint(point.phase, op, point.live_bytes, point.peak_bytes)
        for point_, start, end in self._marked:
            if point_ is point:
                self._marked.append((twin, start, end))
                break
        return twin


_STOP_NODES = ("AccumulateGrad",)
_LOSS = "\0loss"
"""The loss's autograd nodes where it is no op of its own (:meth:`StepRecorder.step`)."""


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors inside a value: an op's output or arguments, any nesting of tuples,
    lists and dicts (torch's pytree)."""
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


class StepRecorder:
    """The points of one training step on ``device``, op by op (the module docstring).

    An op's autograd nodes are those reachable from its outputs that no earlier op made,
    found when :meth:`after` is called for it in the forward; its backward point is read
    when the last of them has run, once autograd has released that node's inputs and saved
    tensors (read at the next node's start). The nodes are marked in their ``metadata`` and
    hooked as they are found: the recorder holds no reference to them, so a node the step
    drops (of a value no loss reads) frees what it saved as in training."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self.points: list[TimelinePoint] = []
        self._key = object()  # this recorder's mark in a node's metadata
        self._remaining: dict[str, int] = {}
        self._finished: list[str] = []  # ops whose last node has run, waiting for their reading
        self._handles: list[Any] = []
        self._reader: _Reader | None = None
        self._backward = False
        self._loss_into: TimelinePoint | None = None  # the forward's last point, the loss's too

    # ---- the forward ----------------------------------------------------------------------
    def after(self, op: str, outputs: Any = None) -> None:
        """``op`` has run and returned ``outputs``: in the forward, its point and its
        autograd nodes; in the backward (the op run again by a recomputation), a
        ``recompute`` point. Nothing outside :meth:`step`."""
        if self._reader is None:
            return
        if not self._backward:
            self.attribute(op, outputs)
        self.point(op)

    def attribute(self, op: str, outputs: Any) -> None:
        """The autograd nodes reachable from ``outputs`` that no op has yet are ``op``'s."""
        if self._reader is None or self._backward:
            return
        todo = [t.grad_fn for t in tensors_in(outputs) if t.grad_fn is not None]
        count = 0
        while todo:
            fn = todo.pop()
            if fn is None or type(fn).__name__ in _STOP_NODES or self._key in fn.metadata:
                continue
            fn.metadata[self._key] = op
            self._handles.append(fn.register_prehook(self._node_starts))
            self._handles.append(fn.register_hook(lambda grad_inputs, grad_outputs, op=op: self._node_ran(op)))
            count += 1
            todo.extend(nxt for nxt, _ in fn.next_functions)
        if count:
            self._remaining[op] = self._remaining.get(op, 0) + count

    def point(self, op: str) -> None:
        """A point for ``op`` now: ``forward`` before the backward, ``recompute`` in it."""
        if self._reader is None:
            return
        if self._backward:
            self._flush()
            self.points.append(self._reader.point("recompute", op))
        else:
            self.points.append(self._reader.point("forward", op))

    # ---- the step -------------------------------------------------------------------------
    def step(self, forward: Callable[[], Any], loss_fn: Callable[[Any], torch.Tensor], *,
             outputs_held: bool = False, grad_holders: Iterable[torch.Tensor] = (),
             loss_point: bool = False) -> list[TimelinePoint]:
        """Run ``loss_fn(forward()).backward()`` and return its points. ``outputs_held``:
        the outputs live until the backward has ended (the loop people write), else they
        are dropped once the loss has read them. The step starts from no gradients on
        ``grad_holders`` (their gradients are allocated in it, as on a first step), and
        each holder's gradient is as before it afterwards. ``loss_point``: the loss is an
        op of its own (``loss``), in the forward and in the backward."""
        holders = list(grad_holders)
        kept = [(t, t.grad) for t in holders]
        for t in holders:
            t.grad = None
        # Garbage from before freed in the step would read as the step's: it is out of the
        # collector's reach while the step runs, and what was made since an enclosing block
        # froze the rest is collected first (``measure.peak.peak_bytes``), not every object
        # in the process (a full collection took 0.77 s a step in a Lightning fit).
        with collector_settled(collect=False):
            gc.collect()
            self._reader = _Reader(self.device)
            self._run_step(forward, loss_fn, outputs_held, loss_point, kept)
        return self.points

    def _run_step(self, forward: Callable[[], Any], loss_fn: Callable[[Any], torch.Tensor],
                  outputs_held: bool, loss_point: bool, kept: list[tuple[torch.Tensor, Any]]) -> None:
        assert self._reader is not None
        try:
            with self._reader:
                outputs = forward()
                loss = loss_fn(outputs)
                if not outputs_held:
                    outputs = None
                if loss_point:
                    self.after("loss", loss)
                elif self.points:
                    # The loss, to the outputs' gradients, is part of the forward's last op,
                    # as the simulator counts it (docs/design.md section 4.7).
                    self._loss_into = self.points[-1]
                    self._reader.extend(self._loss_into)
                    self.attribute(_LOSS, loss)
                self._backward = True
                loss.backward()
                del loss
                self._flush()
                outputs = None
        finally:
            self._reader = None
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            for t, grad in kept:
                t.grad = grad

    def _node_starts(self, grad_outputs: Any) -> None:
        # The previous node's inputs and saved tensors are released by now.
        self._flush()

    def _node_ran(self, op: str) -> None:
        self._remaining[op] -= 1
        if self._remaining[op] == 0:
            self._finished.append(op)

    def _flush(self) -> None:
        if self._reader is None:
            return
        if _LOSS in self._finished and self._loss_into is not None:
            self._finished.remove(_LOSS)
            self._reader.extend(self._loss_into)
        if self._finished:
            first = self._reader.point("backward", self._finished[0])
            self.points.append(first)
            self.points.extend(self._reader.same(first, op) for op in self._finished[1:])
            self._finished.clear()


def aligned(points: Sequence[TimelinePoint], ops: Iterable[tuple[str, str]]) -> list[TimelinePoint]:
    """``points`` (a step's, in the order they were read) on the ops of another timeline
    of the same step: one point per ``(phase, op)`` of ``ops``, in its order, the point of
    that op in that phase (the first not taken yet). An op of ``ops`` without one (it made
    no autograd node of its own, or a recomputation stopped before it) reads as the point
    before it in ``ops``, its live bytes throughout. A point of an op ``ops`` lacks hands
    its peak on to the next point read that ``ops`` has, so the highest reading stays."""
    ops = list(ops)
    wanted = Counter(ops)
    found: defaultdict[tuple[str, str], list[TimelinePoint]] = defaultdict(list)
    carried = 0
    last: TimelinePoint | None = None
    for point in points:
        key = (point.phase, point.op)
        if wanted[key] > 0:
            wanted[key] -= 1
            last = replace(point, peak_bytes=max(point.peak_bytes, carried))
            found[key].append(last)
            carried = 0
        else:
            carried = max(carried, point.peak_bytes)
    if last is not None and carried > last.peak_bytes:
        last.peak_bytes = carried
    taken: Counter[tuple[str, str]] = Counter()
    result = []
    live = 0
    for key in ops:
        matches = found.get(key, [])
        if taken[key] < len(matches):
            point = matches[taken[key]]
            taken[key] += 1
        else:
            point = TimelinePoint(key[0], key[1], live, live)
        live = point.live_bytes
        result.append(point)
    return result


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
    whose autograd nodes ran, read after its last node (:class:`StepRecorder`), in the
    order they ran. The parameters' gradients are set to None for the step (first-step
    behaviour: they are allocated during the backward) and restored afterwards.
    ``loss_fn`` defaults to the sum of the output's elements.
    """
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    if device is None:
        first = next(iter(module.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
    recorder = StepRecorder(device)
    return recorder.step(
        lambda: _forward_with_points(module, example_inputs, recorder),
        loss_fn or (lambda out: sum(t.sum() for t in tensors_in(out))),
        grad_holders=list(module.parameters()), loss_point=True)


def _forward_with_points(module: torch.nn.Module, inputs: tuple, recorder: StepRecorder) -> Any:
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
                result = super().run_node(n)
                recorder.attribute(n.name, result)
                self.previous = n.name
                return result

            def flush(self) -> None:
                if self.previous is not None:
                    recorder.point(self.previous)
                    self.previous = None

        interpreter = PointInterpreter(traced)
        output = interpreter.run(*inputs)
        interpreter.flush()
        return output

    leaves = [(name, m) for name, m in module.named_modules() if not list(m.children())]
    handles = [leaf.register_forward_hook(lambda mod, args, out, name=name: recorder.after(name, out))
               for name, leaf in leaves]
    try:
        return module(*inputs)
    finally:
        for h in handles:
            h.remove()
