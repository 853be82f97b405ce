"""The first real training step under a plan, measured against the plan's prediction
(docs/design.md section 4.7: predicted against measured, a gap is a bug in the model).

The measurement spans the module's forward, whatever the caller's loop does with the
outputs (its loss), and the backward those outputs start, up to its end: on CUDA the
caching allocator's peak counter, which costs the step nothing; on the CPU one step under
the tensor storage meter (:class:`~lightning_remat.meter.StorageMeter`). The end of the
backward is where autograd runs the callbacks queued while it ran
(``Variable._execution_engine.queue_callback``, queued when the first of the outputs'
gradients is computed, ``torch.autograd.graph.register_multi_grad_hook``).

A dispatch mode the engine restored for its backward cannot leave the mode stack inside
it, so the CPU meter stops counting when the backward ends (it passes ops through from
then on) and leaves the stack at the module's next call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils._pytree import tree_leaves

from lightning_remat.meter import StorageMeter

__all__ = ["StepMeter", "step_meter", "watch_backward"]


class StepMeter(Protocol):
    """Peak bytes of one step above what was allocated when it started."""

    def start(self) -> None:
        """Called as the step's forward starts."""

    def stop(self) -> int:
        """Called when the step's backward has ended; the step's peak bytes."""

    def close(self) -> None:
        """Called outside any forward or backward once ``stop`` has been (or will not be):
        leave the process as it was."""


class _CudaStepMeter:
    """The caching allocator's peak above what was allocated when the step started. Its
    peak counter is reset then (a reading taken before the step is lost)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base = 0

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        self.base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def stop(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device) - self.base)

    def close(self) -> None:
        pass


class _CountingUntilStopped(StorageMeter):
    """The storage meter, passing ops through once stopped."""

    stopped = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.stopped:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class _CpuStepMeter:
    """One step under the storage meter (see the module docstring for when it leaves)."""

    def __init__(self, device: torch.device) -> None:
        self.meter = _CountingUntilStopped(device.type)
        self.entered = False

    def start(self) -> None:
        self.meter.__enter__()
        self.entered = True

    def stop(self) -> int:
        self.meter.stopped = True
        return int(self.meter.peak)

    def close(self) -> None:
        # Modes leave in the reverse order they came: only when it is the innermost.
        if self.entered and _get_current_dispatch_mode() is self.meter:
            self.meter.stopped = True
            self.meter.__exit__(None, None, None)
            self.entered = False


def step_meter(device: torch.device) -> StepMeter:
    """The meter of one step on ``device`` (CUDA: the allocator's counters; else the
    storage meter)."""
    device = torch.device(device)
    if device.type == "cuda":
        return _CudaStepMeter(device)
    return _CpuStepMeter(device)


def watch_backward(outputs: Any, on_end: Callable[[], None]) -> bool:
    """Call ``on_end()`` when the backward that ``outputs`` start has ended; False (and
    no call) when no output requires a gradient."""
    tensors = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        return False
    handle: list[Any] = []

    def started(_: Any) -> None:
        if handle:
            handle.pop().remove()
        torch.autograd.Variable._execution_engine.queue_callback(on_end)

    handle.append(torch.autograd.graph.register_multi_grad_hook(tensors, started, mode="any"))
    return True
