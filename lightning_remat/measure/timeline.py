"""Live bytes op by op through one real step, forward and backward (:func:`record_timeline`):
the measured counterpart of ``solvers.simulate``'s predicted timeline."""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from lightning_remat.measure.allocations import AllocationLog
from lightning_remat.measure.peak import step_meter
from lightning_remat.measure.storage import StorageMeter


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
