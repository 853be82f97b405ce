"""The memory meter: the truth every prediction is held to (docs/design.md section 6).

CUDA: the caching allocator's peak above what was allocated before the call.
CPU: glibc's mmap threshold is fixed at 64 KiB so each tensor buffer is its own mapping,
returned to the kernel on free; the kernel's resident high-water mark (VmHWM) is reset
through ``/proc/self/clear_refs`` and read after the call, minus the resident size before.
That sees every allocation, compiled code included.

``record_timeline`` gives the same readings op by op through one step (forward and
backward), the measured counterpart of ``solvers.simulate``'s predicted timeline.
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

_M_TRIM_THRESHOLD = -1
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


def release_mmap_threshold() -> None:
    """Let glibc serve buffers from its heap again, as its dynamic threshold would once grown
    (32 MiB, trim at 64 MiB). For timing CPU steps after the readings are taken: with every
    tensor a fresh mapping, each allocation pays page faults (CPU steps measured about 1.6x
    slower here). Readings taken after this are less exact (freed heap memory fragments), so
    take them first; :func:`set_mmap_threshold` fixes the threshold again."""
    global _threshold_set
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)
    libc.mallopt(_M_TRIM_THRESHOLD, 64 * 2**20)
    _threshold_set = False


def trim_heap() -> None:
    """Hand freed heap memory back to the kernel, so the next reading starts from the floor."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


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
    trim_heap()
    reset_high_water_mark()
    base = resident_bytes()
    fn()
    return int(high_water_mark() - base)


# glibc's mmap threshold grows with the first large buffer freed from the heap; after that,
# tensor buffers come from the heap and the resident size no longer falls when they are freed.
# Fixing it when the meter is imported, before any such buffer, keeps the CPU readings honest.
try:
    set_mmap_threshold()
except (OSError, RuntimeError):  # not glibc: the CPU meter is unavailable, CUDA still works
    pass


def live_bytes(device: str | torch.device = "cpu") -> int:
    """Bytes in use now: CUDA allocated bytes, or the resident set size on CPU."""
    if is_cuda(device):
        return int(torch.cuda.memory_allocated(device))
    return resident_bytes()


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
    """Live and peak readings relative to the level before the step. The CUDA path and the
    CPU path differ only here: CUDA reads the caching allocator's counters (after a sync);
    CPU reads VmRSS and VmHWM with the mmap threshold at 64 KiB (each tensor buffer its own
    mapping, so a free shows at once)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if not self.cuda:
            set_mmap_threshold()
        gc.collect()
        if not self.cuda:
            # Memory glibc kept from before the threshold was fixed would be reused without
            # touching the resident size: hand it back to the kernel first.
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.reset_peak()
        self.base = self._live()

    def _live(self) -> int:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.memory_allocated(self.device))
        return resident_bytes()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            reset_high_water_mark()

    def read(self) -> tuple[int, int]:
        """(live, peak since the last reset), both relative to the base; resets the peak."""
        live = self._live()
        if self.cuda:
            peak = int(torch.cuda.max_memory_allocated(self.device))
        else:
            peak = high_water_mark()
        self.reset_peak()
        return live - self.base, max(peak, live) - self.base


_STOP_NODES = ("AccumulateGrad",)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors inside an op's output or arguments (tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


class _BackwardAttribution:
    """Which autograd nodes each forward op created: found by walking from the op's output
    ``grad_fn`` towards its inputs' ``grad_fn`` (captured before the op ran, so in-place
    ops are handled). Each op gets one backward point, read after its last node ran."""

    def __init__(self) -> None:
        self.owner: dict[Any, str] = {}
        self.remaining: dict[str, int] = {}
        self.order: list[str] = []

    def attribute(self, op: str, outputs: Any, stop: set[Any]) -> None:
        todo = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
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
    return {t.grad_fn for t in _tensors(args) if t.grad_fn is not None}


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
    loss_fn = loss_fn or (lambda out: sum(t.sum() for t in _tensors(out)))

    old_grads = {p: p.grad for p in module.parameters()}
    for p in old_grads:
        p.grad = None
    points: list[TimelinePoint] = []
    attribution = _BackwardAttribution()
    reader = _Reader(device)
    try:
        output = _forward_with_points(module, example_inputs, reader, points, attribution)
        loss = loss_fn(output)
        del output
        attribution.attribute("loss", loss, set())
        live, peak = reader.read()
        points.append(TimelinePoint("forward", "loss", live, peak))
        _backward_with_points(loss, reader, points, attribution)
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
                    live, peak = reader.read()
                    points.append(TimelinePoint("forward", self.previous, live, peak))
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
        live, peak = reader.read()
        points.append(TimelinePoint("forward", name, live, peak))

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
            live, peak = reader.read()
            for op in finished:
                points.append(TimelinePoint("backward", op, live, peak))
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
